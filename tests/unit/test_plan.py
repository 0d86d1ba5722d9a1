"""The planner's walk and the `zeroshard estimate` / `zeroshard plan` command lines (no probe).

The 3B example of seed 001 (bigscience/T0_3B on one GPU, docs/examples/3b_model.md) is pinned
here: 1 x 80 GB and 1 x 8 GB + 60 GB CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroshard.cli.main import main as zeroshard_main
from zeroshard.cli.plan import parse_bytes
from zeroshard.config import load_config
from zeroshard.errors import ZeroshardError
from zeroshard.estimate import Hardware, Workload, make_plan, spec_from_counts, spec_from_gpt
from zeroshard.estimate.hf_count import count_hf_params
from zeroshard.estimate.plan import STEP_DOWN, format_gb

GB = 2**30
def t0_3b() -> dict[str, object]:
    from test_estimate_spec import T0_3B  # the config.json of seed 001's model, written out

    return dict(T0_3B)


def hw(device_gb: float, cpu_gb: float, devices: int = 1, nvme_path: str | None = None) -> Hardware:
    return Hardware(devices_per_node=devices, device_memory=int(device_gb * GB), cpu_memory=int(cpu_gb * GB),
                    nvme_path=nvme_path)


def test_3b_on_80gb_runs_plain_data_parallel() -> None:
    plan = make_plan(count_hf_params(t0_3b()), Workload(seq_len=512), hw(80, 512))
    assert plan.chosen is not None and plan.chosen.name == "stage 0"
    assert len(plan.decisions) == 1 and "stage 0 (bf16): needs 50.2 GB of 80.0 GB" in plan.decisions[0].line
    assert plan.chosen.micro_batch == 4  # raised while it fits: 4 x 3.6 GB of activations
    assert "margin" in plan.report().splitlines()[-1]


def test_3b_on_8gb_with_60gb_cpu_steps_down_to_full_offload() -> None:
    plan = make_plan(count_hf_params(t0_3b()), Workload(seq_len=512), hw(8, 60))
    names = [d.name for d in plan.decisions]
    assert names == [Setup_label(*c) for c in STEP_DOWN[:7]]
    assert [d.status for d in plan.decisions] == ["too big"] * 6 + ["fits"]
    assert plan.chosen is not None and plan.chosen.name == "stage 3 + offload_optimizer=cpu + offload_param=cpu"
    # The seeds' first step: activation checkpointing would let stage 2 + offload fit.
    assert any("stage 2 + offload_optimizer=cpu would fit" in n for n in plan.notes)
    ckpt = make_plan(count_hf_params(t0_3b()), Workload(seq_len=512, checkpointing=True), hw(8, 60))
    assert ckpt.chosen is not None and ckpt.chosen.name == "stage 2 + offload_optimizer=cpu"


def Setup_label(stage: int, opt: str, param: str) -> str:  # noqa: N802 (mirrors Setup.label)
    parts = [f"stage {stage}"] + ([f"offload_optimizer={opt}"] if opt != "none" else []) + (
        [f"offload_param={param}"] if param != "none" else [])
    return " + ".join(parts)


def test_cpu_budget_decides_too() -> None:
    plan = make_plan(count_hf_params(t0_3b()), Workload(seq_len=512), hw(8, 40))
    assert plan.chosen is None
    assert "too big for the CPU" in plan.decisions[-3].line
    assert all(d.status == "skipped" and "no --nvme-path" in d.line for d in plan.decisions[-2:])


def test_parameters_on_nvme_candidate_is_evaluated() -> None:
    """offload_param.device "nvme" is built: the last candidate is estimated, not skipped, and
    counts the parameter shards as swapped."""
    plan = make_plan(spec_from_counts(30e9, 1e9), Workload(), hw(8, 100, nvme_path="/nvme"))
    nvme = plan.decisions[-1]
    assert "offload_param=nvme" in nvme.name and nvme.status != "skipped", nvme.line
    assert nvme.estimate is not None and nvme.estimate.nvme_params > 0


def test_nvme_candidate_states_the_disk_time_per_step() -> None:
    """With optimizer states on NVMe, every swapped byte is read and written once per step: the
    line gives that traffic and the time it takes at the disk's bandwidth (a lower bound)."""
    spec = count_hf_params(t0_3b())
    fast = Hardware(devices_per_node=1, device_memory=8 * GB, cpu_memory=30 * GB, nvme_path="/nvme",
                    disk_read=2 * GB, disk_write=1 * GB)
    plan = make_plan(spec, Workload(seq_len=512), fast)
    name = "stage 3 + offload_optimizer=nvme + offload_param=cpu"
    d = next(d for d in plan.decisions if d.name == name)
    assert d.estimate is not None
    swapped = d.estimate.nvme
    assert swapped > 30 * GB and d.estimate.nvme_params == 0  # 2.85B params x 12+ bytes of optimizer states
    expect = swapped / (2 * GB) + swapped / (1 * GB)
    assert f">= {expect:.2f} s per step at 2.00 GB/s read, 1.00 GB/s write" in d.line, d.line
    assert f"disk swaps {format_gb(swapped)} read + {format_gb(swapped)} written" in d.line
    unknown = next(d for d in make_plan(spec, Workload(seq_len=512), hw(8, 30, nvme_path="/nvme")).decisions
                   if d.name == name)
    assert "disk bandwidth unknown" in unknown.line


def test_plan_cli_measures_the_nvme_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = zeroshard_main(["plan", "--params", "3e9", "--devices", "1", "--device-memory", "8GB",
                         "--cpu-memory", "30GB", "--nvme-path", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc in (0, 1)
    assert f"GB/s write on {tmp_path}" in out and "s per step at" in out
    assert list(tmp_path.iterdir()) == []  # the scratch file is removed
    zeroshard_main(["plan", "--params", "3e9", "--devices", "1", "--device-memory", "8GB",
                    "--cpu-memory", "30GB", "--nvme-path", str(tmp_path), "--nvme-bandwidth", "1GB,0.5GB"])
    assert "at 1.00 GB/s read, 0.50 GB/s write" in capsys.readouterr().out


def test_fp32_falls_back_to_mixed_precision() -> None:
    spec = count_hf_params(t0_3b())
    plan = make_plan(spec, Workload(seq_len=512, precision="fp32"), hw(6, 56))
    assert any("trying bf16" in n for n in plan.notes)
    assert plan.chosen is not None and plan.chosen.estimate is not None
    assert plan.chosen.estimate.setup.precision == "bf16"


def test_global_batch_sets_micro_batch_and_accumulation() -> None:
    plan = make_plan(spec_from_gpt("25m"), Workload(seq_len=256, global_batch=96, max_micro_batch=16), hw(2, 16, 4))
    c = plan.chosen
    assert c is not None and c.ds_config is not None
    assert c.micro_batch == 12 and c.ds_config["gradient_accumulation_steps"] == 2
    cfg = load_config(c.ds_config, dp_world_size=4)
    assert cfg.train_batch_size == 96
    with pytest.raises(ZeroshardError, match="not a multiple"):
        make_plan(spec_from_gpt("25m"), Workload(seq_len=256, global_batch=10), hw(2, 16, 4))


def test_parse_bytes() -> None:
    assert parse_bytes("80GB") == 80 * GB and parse_bytes("512GiB") == 512 * GB and parse_bytes("1.5TB") == 1536 * GB
    assert parse_bytes("500MB") == 500 * 2**20 and parse_bytes("8") == 8 * GB
    with pytest.raises(Exception, match="expected a size"):
        parse_bytes("8 apples")


def test_plan_cli_writes_a_loadable_ds_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ds_config.json"
    cfg_path = tmp_path / "t0.json"
    cfg_path.write_text(json.dumps(t0_3b()))
    rc = zeroshard_main(["plan", "--model", str(cfg_path), "--devices", "1", "--device-memory", "8GB",
                         "--cpu-memory", "60GB", "--activation-checkpointing", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "stage 0 (bf16): needs" in text and "choice: stage 2 + offload_optimizer=cpu" in text
    written = json.loads(out.read_text())
    assert written["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert load_config(written, dp_world_size=1).zero_optimization.stage == 2


def test_plan_cli_keeps_the_base_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"train_batch_size": 8, "gradient_clipping": 0.5,
                                "optimizer": {"type": "Lamb", "params": {"lr": 0.01}}, "fp16": {"enabled": True}}))
    out = tmp_path / "out.json"
    rc = zeroshard_main(["plan", "--model", "gpt:tiny", "--devices", "2", "--device-memory", "1GB",
                         "--cpu-memory", "4GB", "--global-batch", "8", "--config", str(base), "--out", str(out)])
    assert rc == 0, capsys.readouterr()
    written = json.loads(out.read_text())
    assert written["optimizer"]["type"] == "Lamb" and written["gradient_clipping"] == 0.5
    assert written["fp16"] == {"enabled": True} and written["train_batch_size"] == 8


def test_plan_cli_exit_status_when_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    rc = zeroshard_main(["plan", "--params", "70B", "--devices", "1", "--device-memory", "8GB", "--cpu-memory", "64GB"])
    assert rc == 1 and "no configuration fits" in capsys.readouterr().out
    rc = zeroshard_main(["plan", "--params", "7B", "--largest-layer", "9B", "--devices", "1",
                         "--device-memory", "8GB", "--cpu-memory", "64GB"])
    assert rc == 2 and "largest layer" in capsys.readouterr().err


def test_estimate_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc = zeroshard_main(["estimate", "--params", "2783959040", "--largest-layer", "65798144", "--deepspeed"])
    text = capsys.readouterr().out
    assert rc == 0
    assert text.count("stage  offload_optimizer") == 2  # bf16 and fp32 tables
    assert "   70.00GB |   0.25GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1" in text
    row = next(ln for ln in text.splitlines() if ln.strip().startswith("2  cpu"))
    assert row.split("|")[1].split()[0] == "5.19"  # 2 bytes x 2.78B params stay on the device


def test_estimate_cli_activations_and_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                               "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}}))
    rc = zeroshard_main(["estimate", "--model", "gpt:25m", "--devices", "4", "--config", str(cfg),
                         "--seq-len", "256", "--micro-batch", "8"])
    text = capsys.readouterr().out
    assert rc == 0 and text.count("stage  offload_optimizer") == 1 and "bf16 mixed precision" in text
    assert "with activation checkpointing" in text and "without activation checkpointing" in text


def test_activation_checkpointing_is_a_planned_choice_with_its_cost() -> None:
    plan = make_plan(count_hf_params(t0_3b()), Workload(seq_len=512, checkpointing="auto"), hw(8, 60))
    names = [d.name for d in plan.decisions]
    assert names[:4] == ["stage 0", "stage 1", "stage 2", "stage 2 + activation checkpointing"]
    assert plan.chosen is not None and plan.chosen.checkpointing
    assert plan.chosen.name == "stage 2 + offload_optimizer=cpu + activation checkpointing"
    assert "recompute costs ~33% more compute per step" in plan.chosen.line
    assert any("gradient_checkpointing_enable()" in n for n in plan.notes)
    assert not any(n.startswith("hint:") for n in plan.notes), "a choice now, not a hint"
    # Where it fits without recompute, auto never picks it.
    roomy = make_plan(count_hf_params(t0_3b()), Workload(seq_len=512, checkpointing="auto"), hw(80, 512))
    assert roomy.chosen is not None and not roomy.chosen.checkpointing and roomy.chosen.name == "stage 0"
