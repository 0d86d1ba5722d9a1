"""Hugging Face Trainer and Accelerate on zeroshard through the `deepspeed` alias, unmodified.

Each flow is a script under tests/launch/scripts/ written the way the seeds' guides (001, 004)
write it; it runs with ZEROSHARD_AS_DEEPSPEED=1 so that `import deepspeed` inside transformers
and accelerate is zeroshard. Where a real DeepSpeed 0.19 is installed (the optional `[bench]`
extra), the same script also runs under it and the per-step loss, grad norm and lr must agree
within fp32 1e-5 (tests marked `deepspeed`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torchrun_cmd import torchrun as torchrun_cmd

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None and not os.environ.get("ZEROSHARD_AS_DEEPSPEED")
TOL = 1e-5
TIMES: dict[str, float] = {}
DEVIATIONS: dict[str, dict[str, float]] = {}
"""Per compared flow: the largest relative deviation of each logged quantity from DeepSpeed's.
With ZEROSHARD_HF_FLOWS_REPORT=path, teardown writes TIMES and DEVIATIONS there as JSON
(bench/hf_flows.py renders them as the table in bench/hf_flows.md)."""


def run(cmd: list[str], engine: str, cwd: Path, nproc: int = 1, accelerate: list[str] | None = None,
        timeout: int = 600, label: str = "", torchrun: bool = False) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROSHARD_AS_DEEPSPEED", "RANK", "WORLD_SIZE",
                                                           "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", ZEROSHARD_ALIAS_QUIET="1", TOKENIZERS_PARALLELISM="false")
    if engine == "zeroshard":
        env["ZEROSHARD_AS_DEEPSPEED"] = "1"
    else:
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".ds_build"))
    if accelerate is not None:
        full = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed",
                "--num_processes", str(nproc), "--main_process_port", "0", *accelerate, *cmd]
    elif nproc > 1 or torchrun:  # a lone DeepSpeed process needs torchrun (or MPI) for its group
        full = torchrun_cmd(nproc, *cmd)
    else:
        full = [sys.executable, *cmd]
    t = time.perf_counter()
    proc = subprocess.run(full, cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout)
    key = label or ' '.join(c for c in cmd if not c.startswith('/'))[:60]
    TIMES[f"{engine}|{key}|{nproc}"] = time.perf_counter() - t
    assert proc.returncode == 0, f"{engine}: {' '.join(full)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def trainer(tmp: Path, engine: str, name: str, *extra: str, nproc: int = 1, torchrun: bool = False) -> dict[str, Any]:
    out = tmp / engine / name
    results = tmp / engine / f"{name}.json"
    run([str(SCRIPTS / "hf_trainer.py"), "--out", str(out), "--results", str(results), *extra], engine, tmp, nproc,
        label=f"trainer {name}", torchrun=torchrun)
    return json.loads(results.read_text())


def relative(x: float, y: float) -> float:
    return abs(x - y) / max(abs(y), 1e-12)


def note_deviation(what: str, key: str, dev: float) -> None:
    seen = DEVIATIONS.setdefault(what, {})
    seen[key] = max(seen.get(key, 0.0), dev)


def assert_same_log(a: list[dict], b: list[dict], what: str) -> None:
    assert [x["step"] for x in a] == [x["step"] for x in b], what
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "learning_rate"):
            if key in x:
                note_deviation(what, key, relative(x[key], y[key]))
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "learning_rate"):
            if key in x:
                assert relative(x[key], y[key]) <= TOL, f"{what} step {x['step']} {key}: {x[key]} vs {y[key]}"


def test_trainer_zero2_auto_config_resume_and_zero_to_fp32(tmp_path: Path) -> None:
    """--deepspeed with "auto" values, DeepSpeed's optimizer and scheduler from the config,
    gradient accumulation 2, save every 4 steps, resume_from_checkpoint in a new process, then
    the zero_to_fp32.py written into the checkpoint gives the weights save_model wrote."""
    whole = trainer(tmp_path, "zeroshard", "whole", "--steps", "6")
    first = trainer(tmp_path, "zeroshard", "part", "--steps", "4", "--save-steps", "4",
                    "--save-model", str(tmp_path / "final4"))
    resumed = trainer(tmp_path, "zeroshard", "part", "--steps", "6", "--resume")
    # The lr schedule's length follows max_steps (WarmupDecayLR total_num_steps "auto"), so only
    # the first step's values, before any decay, are comparable across the two runs' first half.
    assert first["log"][0] == whole["log"][0]
    assert_same_log(resumed["log"][-2:], whole["log"][-2:], "resumed vs uninterrupted")
    assert whole["log"][-1]["loss"] < 4.9 and len({x["learning_rate"] for x in whole["log"]}) > 2
    ckpt = tmp_path / "zeroshard" / "part" / "checkpoint-4"
    assert (ckpt / "zero_to_fp32.py").exists() and (ckpt / "global_step4").is_dir()
    subprocess.run([sys.executable, "zero_to_fp32.py", ".", "pytorch_model.bin"], cwd=ckpt, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, timeout=300)
    from safetensors.torch import load_file

    fp32 = torch.load(ckpt / "pytorch_model.bin")
    saved = load_file(tmp_path / "final4" / "model.safetensors")
    assert set(saved) <= set(fp32) and all(torch.equal(fp32[k], saved[k].float()) for k in saved)


def peft_lora(tmp: Path, engine: str, stage: int) -> dict[str, Any]:
    results = tmp / engine / f"peft{stage}.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    run([str(SCRIPTS / "hf_peft_lora.py"), "--stage", str(stage), "--results", str(results)], engine, tmp, 2,
        label=f"peft lora stage {stage}")
    return json.loads(results.read_text())


def test_peft_lora_zero3_equals_stage0_world2(tmp_path: Path) -> None:
    """PEFT LoRA (frozen base weights, trainable adapters) at ZeRO-3 with every base weight
    partitioned, 2 ranks: the losses are stage 0's. Before the fix in stage3.py the first
    backward died with "setStorage ... out of bounds for storage of size 0"."""
    stage0, stage3 = peft_lora(tmp_path, "zeroshard", 0), peft_lora(tmp_path, "zeroshard", 3)
    assert stage3["trainable"] == stage0["trainable"] < 20_000
    for a, b in zip(stage3["losses"], stage0["losses"], strict=True):
        assert relative(a, b) <= TOL, (stage3["losses"], stage0["losses"])


@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs DeepSpeed 0.19 (the [bench] extra)")
def test_peft_lora_zero3_equals_deepspeed_world2(tmp_path: Path) -> None:
    ours, theirs = peft_lora(tmp_path, "zeroshard", 3), peft_lora(tmp_path, "deepspeed", 3)
    for a, b in zip(ours["losses"], theirs["losses"], strict=True):
        assert relative(a, b) <= TOL, (ours["losses"], theirs["losses"])


def trainer_sp(tmp: Path, engine: str, stage: int, oracle: bool = True) -> dict[str, Any]:
    out, results = tmp / engine / f"sp-{stage}", tmp / engine / f"sp-{stage}.json"
    run([str(SCRIPTS / "hf_trainer_sp.py"), "--stage", str(stage), "--out", str(out), "--results", str(results),
         *(["--oracle"] if oracle else [])], engine, tmp, 2, label=f"trainer sp stage {stage}")
    return json.loads(results.read_text())


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_sequence_parallel_equals_one_process_world2(tmp_path: Path, stage: int) -> None:
    """Transformers' Trainer with Accelerate's ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    (ALST: the Ulysses attention swap, the data-loader adapter, the token-weighted loss), through the
    alias: the losses and final weights equal the same model trained in one process on the whole
    samples the run saw. At ZeRO 3 this holds because the alias keeps DeepSpeed 0.19.8's averaging,
    which the Trainer compensates for (sequence/sp_setup.py); summing there gave 8.2 relative."""
    got = trainer_sp(tmp_path, "zeroshard", stage)
    assert len(got["samples"]) == len(got["log"]) == 4
    for step, (a, b) in enumerate(zip([h["loss"] for h in got["log"]], got["oracle_losses"], strict=True)):
        assert relative(a, b) <= TOL, (step, got["log"], got["oracle_losses"])
    assert got["max_weight_rel"] <= 2e-6, got["max_weight_rel"]


@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs DeepSpeed 0.19 (the [bench] extra)")
@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_sequence_parallel_equals_deepspeed_world2(tmp_path: Path, stage: int) -> None:
    ours, theirs = trainer_sp(tmp_path, "zeroshard", stage, False), trainer_sp(tmp_path, "deepspeed", stage, False)
    assert ours["samples"] == theirs["samples"]
    for a, b in zip([h["loss"] for h in ours["log"]], [h["loss"] for h in theirs["log"]], strict=True):
        assert relative(a, b) <= TOL, (ours["log"], theirs["log"])
    for name, norm in theirs["norms"].items():
        assert relative(ours["norms"][name], norm) <= TOL, name


@pytest.mark.parametrize("model, stage", [("mixtral", 2), ("mixtral", 3), ("deepseek_v3", 2)])
def test_trainer_autoep_equals_one_process_world2(tmp_path: Path, model: str, stage: int) -> None:
    """Transformers' Trainer on a tiny Mixtral / DeepSeek-V3 with `"expert_parallel": {"enabled":
    true, "autoep_size": 2}` in its ds_config, through the alias: each rank holds 2 of the 4 experts of
    every bank, and the logged losses and every rank's parameters equal the unmodified model trained
    in one process on the batches the ranks saw; `Trainer.save_model` writes the whole model
    (`from_pretrained` reads it back equal to the oracle). At ZeRO-3 the model is built as a Trainer user
    loads one, after TrainingArguments (`from_config`, so inside zero.Init: Note: [expert banks under
    zero.Init] in moe/hf_experts.py). (DeepSpeed 0.19.8's AutoEP stops at initialize on transformers-5
    models, so there is no DeepSpeed run to compare with.)"""
    out, results = tmp_path / f"moe-{model}-{stage}", tmp_path / f"moe-{model}-{stage}.json"
    run([str(SCRIPTS / "hf_trainer_moe.py"), "--model", model, "--stage", str(stage), "--out", str(out),
         "--results", str(results), *(["--after-args"] if stage == 3 else [])], "zeroshard", tmp_path, 2,
        label=f"trainer autoep {model} stage {stage}")
    got = json.loads(results.read_text())
    assert got["banks"] >= 1 and got["local_experts"] == [2], got
    assert len(got["log"]) == len(got["oracle_losses"]) == 4, got
    for step, (a, b) in enumerate(zip(got["log"], got["oracle_losses"], strict=True)):
        assert relative(a, b) <= TOL, (step, got["log"], got["oracle_losses"])
    assert got["max_weight_rel"] <= 2e-6, got["max_weight_rel"]
    assert got["saved_rel"] <= 2e-6, got["saved_rel"]  # the saved model has every expert


def test_trainer_hf_optimizer_offload_eval_world2(tmp_path: Path) -> None:
    """HF's own AdamW and scheduler (no optimizer section; zero_allow_untested_optimizer) with CPU
    optimizer offload at 2 ranks, then Trainer.evaluate()."""
    got = trainer(tmp_path, "zeroshard", "hf_opt", "--optim", "hf", "--offload", "--eval", nproc=2)
    assert got["world_size"] == 2 and got["global_step"] == 4
    assert 4.0 < got["eval_loss"] < 5.5 and got["log"][-1]["learning_rate"] > 0


def test_trainer_zero3_init_eval_save16_world2(tmp_path: Path) -> None:
    """ZeRO-3 at 2 ranks: the model is built under zero.Init by from_config (transformers then
    initialises its weights through GatheredParameters before initialize()), HF's optimizer,
    Trainer.evaluate() (ZeRO inference) and save_model with stage3_gather_16bit_weights_on_model_save;
    without that key save_model writes no weights file, as with DeepSpeed."""
    got = trainer(tmp_path, "zeroshard", "z3", "--stage", "3", "--optim", "hf", "--eval", "--gather16",
                  "--save-model", str(tmp_path / "z3_final"), nproc=2)
    assert got["world_size"] == 2 and got["global_step"] == 4 and 4.0 < got["eval_loss"] < 5.5
    assert "model.safetensors" in got["saved"]
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "z3_final" / "model.safetensors")
    assert weights["model.embed_tokens.weight"].shape == (128, 32), "whole tensors, not shards"
    plain = trainer(tmp_path, "zeroshard", "z3_nogather", "--stage", "3", "--steps", "1",
                    "--save-model", str(tmp_path / "z3_nogather_final"))
    assert "model.safetensors" not in plain["saved"]


def test_trainer_save_on_each_node_world2(tmp_path: Path, monkeypatch: Any) -> None:
    """TrainingArguments(save_on_each_node=True) sets checkpoint.use_node_local_storage; with two
    simulated nodes (ZEROSHARD_NODE_SIZE=1) writing to one output_dir, rank 1 finds rank 0's token
    in the staging directory and leaves the writing to it, so Trainer's resume_from_checkpoint in a
    new job continues the uninterrupted run (tests/dist/test_node_local_checkpoint.py has separate
    disks per node)."""
    monkeypatch.setenv("ZEROSHARD_NODE_SIZE", "1")
    whole = trainer(tmp_path, "zeroshard", "whole", "--steps", "6", "--save-on-each-node", nproc=2)
    part = trainer(tmp_path, "zeroshard", "part", "--steps", "4", "--save-steps", "4", "--save-on-each-node", nproc=2)
    resumed = trainer(tmp_path, "zeroshard", "part", "--steps", "6", "--resume", "--save-on-each-node", nproc=2)
    assert whole["node_local"] is True and part["world_size"] == 2
    assert_same_log(resumed["log"][-2:], whole["log"][-2:], "save_on_each_node: resumed vs uninterrupted")
    from zeroshard.checkpoint.manifest import read_manifest

    ckpt = tmp_path / "zeroshard" / "part" / "checkpoint-4" / "global_step4"
    assert read_manifest(ckpt).node_ranks is None  # one shared directory: the ordinary checkpoint


def test_trainer_autotp2_equals_tp1_world2(tmp_path: Path) -> None:
    """The ds_config's "tensor_parallel": {"autotp_size": 2} at 2 ranks: Trainer calls
    deepspeed.tp_model_init, fills train_batch_size over every rank as DeepSpeed counts it, and
    hands initialize the parameters from before the sharding; each step's loss, grad norm and lr
    equal the same model trained at TP 1 on one rank (the TP ranks see the same samples)."""
    tp2 = trainer(tmp_path, "zeroshard", "autotp2", "--autotp", "2", nproc=2)
    tp1 = trainer(tmp_path, "zeroshard", "tp1", torchrun=False)
    assert tp2["world_size"] == 2 and len(tp2["log"]) == 4
    assert_same_log(tp2["log"], tp1["log"], "trainer autotp 2 vs tp 1")


@pytest.mark.parametrize("stage", [2, 3])
def test_nontrainer_generate_synced_world2(tmp_path: Path, stage: int) -> None:
    """HfDeepSpeedConfig + deepspeed.initialize + generate(synced_gpus=True): ranks asking for
    different lengths all finish and each gets its own length."""
    run([str(SCRIPTS / "hf_nontrainer.py"), "--stage", str(stage), "--results", str(tmp_path / "r")],
        "zeroshard", tmp_path, nproc=2)
    r0, r1 = (json.loads((tmp_path / f"r.rank{r}").read_text()) for r in (0, 1))
    assert (r0["new_tokens"], r1["new_tokens"]) == (2, 5)
    assert r0["generated"][:4] == r1["generated"][:4] and r0["generated"] == r1["generated"][:6]


ACCELERATE_FLOWS = {
    "config_file": ["--deepspeed_config_file", "{cfg}"],
    "zero3_flags": ["--zero_stage", "3", "--zero3_init_flag", "true", "--zero3_save_16bit_model", "true",
                    "--gradient_accumulation_steps", "2", "--gradient_clipping", "1.0"],
    "flags": ["--zero_stage", "2", "--offload_optimizer_device", "cpu", "--gradient_accumulation_steps", "2",
              "--gradient_clipping", "1.0"],
}


def accelerate(tmp: Path, engine: str, name: str) -> dict[str, Any]:
    cfg = tmp / "acc_ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
                               "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
                               "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}))
    flags = [f.format(cfg=cfg) for f in ACCELERATE_FLOWS[name]]
    results = tmp / engine / f"acc_{name}.json"
    results.parent.mkdir(parents=True, exist_ok=True)
    run([str(SCRIPTS / "hf_accelerate.py"), "--out", str(tmp / engine / name), "--results", str(results)],
        engine, tmp, accelerate=flags, label=f"accelerate {name}")
    return json.loads(results.read_text())


@pytest.mark.parametrize("name", sorted(ACCELERATE_FLOWS))
def test_accelerate_launch_use_deepspeed(tmp_path: Path, name: str) -> None:
    """accelerate launch --use_deepspeed (a config file, or accelerate's own flags): DummyOptim/
    DummyScheduler or a torch optimizer, accumulate, save_state/load_state, get_state_dict +
    save_pretrained, engine.save_checkpoint."""
    got = accelerate(tmp_path, "zeroshard", name)
    assert got["engine"] == "zeroshard.runtime.engine.ZeroEngine"
    assert len(got["losses"]) == 8 and all(4.0 < loss < 5.5 for loss in got["losses"])
    assert {"latest", "pytorch_model"} <= set(got["state_files"]) and "model.safetensors" in got["pretrained"]
    assert got["state_dict_keys"] > 0
    assert (tmp_path / "zeroshard" / name / "ckpt" / "zero_to_fp32.py").exists()


@pytest.mark.deepspeed  # opt-in: tests/run.py --deepspeed (tests/conftest.py)
@pytest.mark.skipif(not HAS_DEEPSPEED,
                    reason="the differential flows need a real DeepSpeed 0.19 (pip install -e .[bench])")
class TestAgainstDeepSpeed:
    """The same scripts under real DeepSpeed 0.19: per-step loss, grad norm and lr within 1e-5."""

    def test_trainer_zero2(self, tmp_path: Path) -> None:
        a = trainer(tmp_path, "zeroshard", "zero2 ds-optim", "--steps", "4", torchrun=True)
        b = trainer(tmp_path, "deepspeed", "zero2 ds-optim", "--steps", "4", torchrun=True)
        assert_same_log(a["log"], b["log"], "trainer zero2 ds-optim|1")

    @pytest.mark.parametrize("nproc", [1, 2])
    def test_trainer_hf_optimizer_offload(self, tmp_path: Path, nproc: int) -> None:
        flags = ("--optim", "hf", "--offload", "--eval")
        a = trainer(tmp_path, "zeroshard", "zero2 hf-optim offload eval", *flags, nproc=nproc, torchrun=True)
        b = trainer(tmp_path, "deepspeed", "zero2 hf-optim offload eval", *flags, nproc=nproc, torchrun=True)
        what = f"trainer zero2 hf-optim offload eval|{nproc}"
        assert_same_log(a["log"], b["log"], what)
        note_deviation(what, "eval_loss", relative(a["eval_loss"], b["eval_loss"]))
        assert relative(a["eval_loss"], b["eval_loss"]) <= TOL

    @pytest.mark.parametrize("nproc", [1])
    def test_trainer_zero3(self, tmp_path: Path, nproc: int) -> None:
        """zero.Init through from_config, HF's optimizer, evaluate() (ZeRO inference), save_model
        with stage3_gather_16bit_weights_on_model_save: the saved weights must match too. Not at 2
        CPU ranks: DeepSpeed 0.19.8 stops there in its batch check (its config, built by zero.Init
        for from_config, counts a world of 1: "8 != 2 * 2 * 1"); zeroshard runs it
        (test_trainer_zero3_init_eval_save16_world2). See bench/hf_flows.md."""
        flags = ("--stage", "3", "--optim", "hf", "--eval", "--gather16")
        a = trainer(tmp_path, "zeroshard", "zero3 hf-optim eval save16", *flags,
                    "--save-model", str(tmp_path / "a_final"), nproc=nproc, torchrun=True)
        b = trainer(tmp_path, "deepspeed", "zero3 hf-optim eval save16", *flags,
                    "--save-model", str(tmp_path / "b_final"), nproc=nproc, torchrun=True)
        what = f"trainer zero3 hf-optim eval save16|{nproc}"
        assert_same_log(a["log"], b["log"], what)
        note_deviation(what, "eval_loss", relative(a["eval_loss"], b["eval_loss"]))
        from safetensors.torch import load_file

        wa = load_file(tmp_path / "a_final" / "model.safetensors")
        wb = load_file(tmp_path / "b_final" / "model.safetensors")
        assert wa.keys() == wb.keys()
        dev = max(float((wa[k] - wb[k]).abs().max() / wb[k].abs().max().clamp_min(1e-12)) for k in wb)
        note_deviation(what, "saved_weights", dev)
        assert relative(a["eval_loss"], b["eval_loss"]) <= TOL and dev <= TOL

    def test_trainer_resume(self, tmp_path: Path) -> None:
        """save_steps then resume_from_checkpoint in a new process. zeroshard's resumed steps must
        equal DeepSpeed's uninterrupted run. DeepSpeed 0.19.8's own resumed run departs from its
        uninterrupted one after the first resumed step (measured: loss 8.8e-5, grad norm 7.1e-4
        relative at step 6 of this flow); that is recorded, not asserted (bench/hf_flows.md)."""
        whole = trainer(tmp_path, "deepspeed", "zero2 uninterrupted", "--steps", "6", torchrun=True)
        for engine in ("zeroshard", "deepspeed"):
            trainer(tmp_path, engine, "zero2 save4", "--steps", "4", "--save-steps", "4", torchrun=True)
        a = trainer(tmp_path, "zeroshard", "zero2 save4", "--steps", "6", "--resume", torchrun=True)
        b = trainer(tmp_path, "deepspeed", "zero2 save4", "--steps", "6", "--resume", torchrun=True)
        # The resumed logs repeat steps 1-4 from trainer_state.json (their lr schedule ran to
        # max_steps=4); steps 5-6 are the ones run after the reload.
        for x, y in zip(b["log"][-2:], whole["log"][-2:], strict=True):
            for key in ("loss", "grad_norm", "learning_rate"):
                note_deviation("trainer zero2 resume: DeepSpeed resumed vs DeepSpeed uninterrupted|1", key,
                               relative(x[key], y[key]))
        assert_same_log(a["log"][-2:], whole["log"][-2:], "trainer zero2 resume vs DeepSpeed uninterrupted|1")

    def test_trainer_autotp2(self, tmp_path: Path) -> None:
        """"tensor_parallel": {"autotp_size": 2} at 2 ranks through Trainer (tp_model_init)."""
        a = trainer(tmp_path, "zeroshard", "zero2 autotp2", "--autotp", "2", nproc=2)
        b = trainer(tmp_path, "deepspeed", "zero2 autotp2", "--autotp", "2", nproc=2)
        assert_same_log(a["log"], b["log"], "trainer zero2 autotp2|2")

    @pytest.mark.parametrize("stage", [2, 3])
    def test_nontrainer_generate(self, tmp_path: Path, stage: int) -> None:
        """HfDeepSpeedConfig + deepspeed.initialize + generate(synced_gpus=True) at 2 ranks (a lone
        process cannot start under DeepSpeed without MPI)."""
        got = {}
        for engine in ("zeroshard", "deepspeed"):
            run([str(SCRIPTS / "hf_nontrainer.py"), "--stage", str(stage), "--results", str(tmp_path / engine)],
                engine, tmp_path, nproc=2, label=f"nontrainer zero{stage} generate")
            got[engine] = [json.loads((tmp_path / f"{engine}.rank{r}").read_text()) for r in (0, 1)]
        what = f"nontrainer zero{stage} generate|2"
        for a, b in zip(got["zeroshard"], got["deepspeed"]):
            for x, y in zip(a["losses"], b["losses"], strict=True):
                note_deviation(what, "loss", relative(x, y))
            assert a["generated"] == b["generated"], (a, b)
        for a, b in zip(got["zeroshard"], got["deepspeed"]):
            assert all(relative(x, y) <= TOL for x, y in zip(a["losses"], b["losses"]))

    @pytest.mark.parametrize("name", sorted(ACCELERATE_FLOWS))
    def test_accelerate(self, tmp_path: Path, name: str) -> None:
        a, b = accelerate(tmp_path, "zeroshard", name), accelerate(tmp_path, "deepspeed", name)
        what = f"accelerate {name}|1"
        for key in ("losses", "lrs"):
            for x, y in zip(a[key], b[key], strict=True):
                note_deviation(what, key, relative(x, y))
        for x, y in zip(a["losses"] + a["lrs"], b["losses"] + b["lrs"], strict=True):
            assert relative(x, y) <= TOL, (a, b)


def teardown_module() -> None:
    if TIMES:
        print("\n" + "\n".join(f"[hf flow] {k}: {v:.1f} s" for k, v in TIMES.items()))
    report = os.environ.get("ZEROSHARD_HF_FLOWS_REPORT")
    if report:
        old = json.loads(Path(report).read_text()) if Path(report).exists() else {"times": {}, "deviations": {}}
        old["times"].update(TIMES)
        old["deviations"].update(DEVIATIONS)
        Path(report).write_text(json.dumps(old, indent=1))
