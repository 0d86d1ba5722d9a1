"""LLaMA-Factory 0.9.5's SFT and DPO, started as its users start them (`llamafactory-cli train config.yaml`,
`deepspeed:` naming a ZeRO config, FORCE_TORCHRUN=1 for its torchrun launch), through the `deepspeed`
alias: SFT at 1 and 2 ranks with ZeRO-2 and ZeRO-3, and DPO with ZeRO-3 at 2 ranks (its reference model
wrapped by TRL's `prepare_deepspeed`), give the per-step losses, grad norms, learning rates (and DPO's
rewards) of ZeRO-0 in one process at the same global batch; opt-in (`deepspeed` marker), the same runs
under a real DeepSpeed 0.19.8 give zeroshard's (ZeRO-2 at 2 ranks, ZeRO-3 at 1: see the note there).
The client's code is not changed.

LLaMA-Factory is not a zeroshard dependency, and its pins (trl<=0.24, transformers<=5.6) conflict with the
suite's (trl 1.16, transformers 5.25): it lives in its own directory, put first on the jobs' PYTHONPATH
only, with the TRL it imports (0.24.0: LLaMA-Factory imports `trl.AutoModelForCausalLMWithValueHead`,
which TRL 1.x removed) and omegaconf; everything else is the suite's. LLaMA-Factory's own switch
`DISABLE_VERSION_CHECK=1` skips its version assert. Two things LLaMA-Factory needs are answered by the
configs, not by changes: `disable_gradient_checkpointing: true` (its checkpointing wrapper reads
`func.func.__self__`, which Transformers 5.25's layers no longer pass), and no `warmup_ratio`
(Transformers 5 removed it). `torchaudio` (imported at module level for audio inputs, unused for text)
has no build for torch 2.13 on CPU (PyPI's 2.11.1 is linked against CUDA torch 2.11), so where it is not
installed the jobs import an empty stand-in from scripts/llamafactory_stubs/.

Run it as a user would (what each test does; CI installs the directory, .ci/run):

    pip install --no-deps --target .llamafactory-site llamafactory==0.9.5 trl==0.24.0 omegaconf==2.4.0
    PYTHONPATH=.llamafactory-site:tests/launch/scripts/llamafactory_stubs ZEROSHARD_AS_DEEPSPEED=1 \\
        DISABLE_VERSION_CHECK=1 FORCE_TORCHRUN=1 NPROC_PER_NODE=2 python -m llamafactory.cli train sft.yaml

(`python -m llamafactory.cli` is the `llamafactory-cli` console script's `main`; `--target` leaves the
script itself in .llamafactory-site/bin), with sft.yaml as `config()` writes it (`deepspeed:
ds_z3_config.json`). Without the directory
(ZEROSHARD_LLAMAFACTORY_SITE, default .llamafactory-site) these tests skip, saying so; where
ZEROSHARD_LLAMAFACTORY_SITE is set (CI), they never skip.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from test_hf_flows import HAS_DEEPSPEED, SCRIPTS, relative

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("ZEROSHARD_LLAMAFACTORY_SITE", ROOT / ".llamafactory-site"))
STUBS = SCRIPTS / "llamafactory_stubs"
pytestmark = pytest.mark.skipif(
    "ZEROSHARD_LLAMAFACTORY_SITE" not in os.environ and not (SITE / "llamafactory").is_dir(),
    reason=f"LLaMA-Factory is not installed in {SITE} (pip install --no-deps --target {SITE} llamafactory==0.9.5 "
           "trl==0.24.0 omegaconf==2.4.0)")

GLOBAL_BATCH = 4
STEPS = 4
# fp32: ZeRO-0 in one process and the 2-rank runs reduce the same gradients in another order (and each
# rank's loss is a mean over its half of the batch), so the logged values differ by fp32 round-off carried
# through 4 Adam steps; 1e-5 relative stays far below a defect (a skipped or doubled step, a gradient
# averaged over the wrong count, moves the loss by ~1e-3 here).
TOL = 1e-5
# DPO's rewards are beta times a difference of two log-probabilities of ~-20, so their fp32 round-off is
# absolute (measured: 3.8e-8 on a reward of 0.005, 7.6e-6 relative): a reward passes within 1e-6 absolute,
# still far below a defect (one step more or less moves the rewards by ~1e-3).
REWARD_ATOL = 1e-6
KEYS = ("loss", "grad_norm", "learning_rate", "rewards/chosen", "rewards/margins")
DATASETS = {"sft": "tiny_alpaca", "dpo": "tiny_pairs"}
TIMES: dict[str, float] = {}
DEVIATIONS: dict[str, float] = {}
"""Seconds per job, and the largest relative deviation per comparison and key: printed at the end of the
module (pytest -s shows them)."""

WORDS = "the a cat dog sat ran on mat fast slow red blue big small yes no".split()


def ds_config(stage: int) -> dict[str, Any]:
    """The keys of LLaMA-Factory's examples/deepspeed/ds_z{0,2,3}_config.json recipes ("auto" filled by
    Transformers; `comms_config` and `monitor_config` are keys DeepSpeed ignores)."""
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True}
    if stage == 2:
        zero.update(allgather_partitions=True, allgather_bucket_size=5e8, reduce_scatter=True,
                    reduce_bucket_size=5e8, round_robin_gradients=True)
    if stage == 3:
        zero.update(sub_group_size=1e9, reduce_bucket_size="auto", stage3_prefetch_bucket_size="auto",
                    stage3_param_persistence_threshold="auto", stage3_max_live_parameters=1e9,
                    stage3_max_reuse_distance=1e9, stage3_gather_16bit_weights_on_model_save=True)
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
            "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                     "hysteresis": 2, "min_loss_scale": 1},
            "bf16": {"enabled": "auto"}, "zero_optimization": zero, "comms_config": {"verbose": False},
            "monitor_config": {"enabled": True, "tag": "DeepSpeedMonitor", "csv_monitor": {"enabled": False}}}


def config(work: Path, out: Path, flow: str, stage: int, nproc: int) -> Path:
    """A full-parameter config in the shape of LLaMA-Factory's examples/train_full/*_sft.yaml (and, for DPO,
    examples/train_lora/*_dpo.yaml's `pref_*` keys), on the tiny local model and data (fp32: no bf16 key;
    CPU)."""
    ds = work / f"ds_z{stage}_config.json"
    ds.write_text(json.dumps(ds_config(stage), indent=2))
    lines = {"model_name_or_path": work / "tiny", "stage": flow, "do_train": "true", "finetuning_type": "full",
             "deepspeed": ds, "dataset": DATASETS[flow], "dataset_dir": work / "data", "template": "default",
             "cutoff_len": 64, "overwrite_cache": "true", "preprocessing_num_workers": 1, "output_dir": out,
             "logging_steps": 1, "save_strategy": '"no"', "overwrite_output_dir": "true", "report_to": "none",
             "per_device_train_batch_size": GLOBAL_BATCH // nproc, "gradient_accumulation_steps": 1,
             "learning_rate": "1.0e-3", "max_steps": STEPS, "lr_scheduler_type": "cosine", "seed": 7,
             "use_cpu": "true", "disable_gradient_checkpointing": "true", "plot_loss": "false"}
    if flow == "dpo":
        lines.update(pref_beta=0.1, pref_loss="sigmoid")
    path = out.parent / f"{out.name}.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in lines.items()))
    return path


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    print("\nLLaMA-Factory jobs (s):", {k: round(v, 1) for k, v in TIMES.items()})
    print("largest relative deviations:", {k: f"{v:.1e}" for k, v in DEVIATIONS.items()})


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama and its byte-level BPE tokenizer (trained here, scripts/trl_flow.py), and an
    alpaca-format SFT set and a pairwise DPO set registered in dataset_info.json. Every row has the same
    token count, so the mean of the ranks' losses is the loss of the global batch."""
    work = tmp_path_factory.mktemp("llamafactory")
    subprocess.run([sys.executable, str(SCRIPTS / "trl_flow.py"), "--make-model", str(work / "tiny")], check=True,
                   capture_output=True, timeout=300)
    prompts = [" ".join(WORDS[(i + j) % 12] for j in range(4)) for i in range(32)]
    answers = [" ".join(WORDS[(3 * i + j) % 16] for j in range(3)) for i in range(32)]
    rejected = [" ".join(WORDS[(5 * i + j + 7) % 16] for j in range(3)) for i in range(32)]
    alpaca = [{"instruction": p, "input": "", "output": a} for p, a in zip(prompts, answers)]
    pairs = [{"instruction": p, "input": "", "chosen": a, "rejected": b} for p, a, b in zip(prompts, answers, rejected)]
    (work / "data").mkdir()
    (work / "data" / "tiny_alpaca.json").write_text(json.dumps(alpaca))
    (work / "data" / "tiny_pairs.json").write_text(json.dumps(pairs))
    (work / "data" / "dataset_info.json").write_text(json.dumps({
        "tiny_alpaca": {"file_name": "tiny_alpaca.json"},
        "tiny_pairs": {"file_name": "tiny_pairs.json", "ranking": True,
                       "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen",
                                   "rejected": "rejected"}}}))
    return work


def train(work: Path, engine: str, flow: str, stage: int, nproc: int) -> list[dict[str, float]]:
    """`llamafactory-cli train` (its console script's `main`, as `python -m llamafactory.cli`) with
    FORCE_TORCHRUN=1: LLaMA-Factory starts torchrun itself. Returns the Trainer's per-step log."""
    out = work / f"{engine}-{flow}-z{stage}-n{nproc}"
    cfg = config(work, out, flow, stage, nproc)
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROSHARD_AS_DEEPSPEED", "RANK", "WORLD_SIZE",
                                                           "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    stub = [] if importlib.util.find_spec("torchaudio") else [str(STUBS)]
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), str(SITE), *stub, *filter(None, [os.environ.get("PYTHONPATH")])]),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
               OMP_NUM_THREADS="1", ZEROSHARD_ALIAS_QUIET="1", TOKENIZERS_PARALLELISM="false",
               DISABLE_VERSION_CHECK="1", FORCE_TORCHRUN="1", NPROC_PER_NODE=str(nproc), HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE=str(work / "hf-datasets"), HF_DATASETS_OFFLINE="1")
    if engine == "zeroshard":
        env["ZEROSHARD_AS_DEEPSPEED"] = "1"
    else:
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".ds_build"))
    cmd = [sys.executable, "-m", "llamafactory.cli", "train", str(cfg)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, text=True, capture_output=True, timeout=900)
    TIMES[f"{engine}|{flow}|zero{stage}|{nproc}"] = time.perf_counter() - t0
    assert proc.returncode == 0, f"{engine} {flow} zero{stage} x{nproc}: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-6000:]}"
    log = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [x for x in log if "loss" in x]


def assert_same(a: list[dict[str, float]], b: list[dict[str, float]], what: str) -> None:
    assert [x["step"] for x in a] == [x["step"] for x in b] == list(range(1, STEPS + 1)), (what, a, b)
    for x, y in zip(a, b):
        for key in filter(x.__contains__, KEYS):
            DEVIATIONS[f"{what} {key}"] = max(DEVIATIONS.get(f"{what} {key}", 0.0), relative(x[key], y[key]))
    for x, y in zip(a, b):
        for key in filter(x.__contains__, KEYS):
            atol = REWARD_ATOL if key.startswith("rewards/") else 0.0
            assert relative(x[key], y[key]) <= TOL or abs(x[key] - y[key]) <= atol, (what, key, x, y)


@pytest.fixture(scope="module")
def stage0(work: Path) -> Callable[[str], list[dict[str, float]]]:
    """ZeRO-0 in one process (the whole global batch per step), per flow, run when first asked for."""
    logs: dict[str, list[dict[str, float]]] = {}

    def get(flow: str) -> list[dict[str, float]]:
        if flow not in logs:
            logs[flow] = train(work, "zeroshard", flow, 0, 1)
            assert logs[flow][0]["grad_norm"] > 0 and len({x["loss"] for x in logs[flow]}) == STEPS, logs[flow]
        return logs[flow]

    return get


@pytest.mark.parametrize("flow, stage, nproc", [("sft", 2, 1), ("sft", 3, 1), ("sft", 2, 2), ("sft", 3, 2),
                                                ("dpo", 3, 2)],
                         ids=["sft_zero2_world1", "sft_zero3_world1", "sft_zero2_world2", "sft_zero3_world2",
                              "dpo_zero3_world2"])
def test_llamafactory_equals_stage0_one_process(work: Path, stage0: Callable[[str], list[dict[str, float]]], flow: str,
                                                stage: int, nproc: int) -> None:
    """At DPO, LLaMA-Factory's trainer wraps its reference model with TRL's `prepare_deepspeed`."""
    assert_same(train(work, "zeroshard", flow, stage, nproc), stage0(flow),
                f"{flow} ZeRO-{stage} x{nproc} vs ZeRO-0 x1")


# DeepSpeed 0.19.8 cannot run ZeRO-3 at 2 ranks here: with `use_cpu` the Trainer starts the process group
# through torch, not deepspeed.init_distributed, so the `deepspeed.zero.Init` around from_pretrained reads a
# world size of 1 from deepspeed.comm and stops ("train_batch_size ... 4 != 2 * 1 * 1"); without `use_cpu`
# the Trainer counts 1 process on a machine without CUDA and DeepSpeed 2 ("2 != 2 * 1 * 2"). So ZeRO-3 is
# compared at 1 rank, ZeRO-2 at 2.
@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs DeepSpeed 0.19 (the [bench] extra)")
@pytest.mark.parametrize("flow, stage, nproc", [("sft", 2, 2), ("sft", 3, 1), ("dpo", 3, 1)],
                         ids=["sft_zero2_world2", "sft_zero3_world1", "dpo_zero3_world1"])
def test_llamafactory_equals_deepspeed(work: Path, flow: str, stage: int, nproc: int) -> None:
    assert_same(train(work, "zeroshard", flow, stage, nproc), train(work, "deepspeed", flow, stage, nproc),
                f"{flow} ZeRO-{stage} x{nproc}: zeroshard vs DeepSpeed 0.19")
