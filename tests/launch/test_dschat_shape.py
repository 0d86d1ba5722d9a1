"""DeepSpeed-Chat step 1 in CI shape (issue 39 item 5): scripts/dschat_step1_shape.py makes
DeepSpeed-Chat's DeepSpeed calls, started as a user starts it (`zeroshard launch --as-deepspeed`,
which passes --local_rank=<i>). Each ZeRO case must give stage 0's per-step losses and saved
weights in one process at the same global batch; opt-in (`deepspeed` marker), the same script
under a real DeepSpeed 0.19.8 must give zeroshard's losses.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "dschat_step1_shape.py"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None and not os.environ.get("ZEROSHARD_AS_DEEPSPEED")
GLOBAL_BATCH = 4
COMMON = ["--learning_rate", "1e-2", "--dtype", "bf16"]
LORA = ["--lora_dim", "4", "--lora_module_name", "layers.", "--only_optimize_lora", "--lora_learning_rate", "5e-2"]
# The ranks share the launcher's stdout, so one rank's line may end without its newline before
# another's begins: the number is matched by its own shape.
LOSS_LINE = re.compile(r"Epoch: (\d+), Step: (\d+), Rank: (\d+), loss = (-?\d+\.\d+(?:e[-+]?\d+)?)")
TIMEOUT_S = 240

# Note: [bf16 tolerance of the DeepSpeed-Chat cases] The model computes in bf16 (unit round-off
# u = 2^-8 = 3.9e-3). At 2 ranks each half of the global batch goes through its own forward and
# backward, and the two bf16 weight gradients are summed across ranks; stage 0 in one process
# accumulates the whole batch's gradient inside one GEMM and rounds it to bf16 once. The gradients
# then differ by about u, and Adam (update ~ lr * sign(g) while its moments are young) turns each
# flipped sign of a near-zero gradient into a weight difference of up to 2 * lr, so single weights
# may differ by tens of percent; the deviation is measured over all saved weights together,
# ||w_a - w_b|| / ||w_b||. Bounds: 2u relative per step on the loss (fp32 from bf16 logits), 4u on
# the weights. Measured by hand (lr 1e-2, 8 steps): two legitimate stage-0 runs of this script in
# one process (micro-batch 4, and micro-batch 2 x gradient accumulation 2) differ by 4.5e-3 on the
# weights; stage 0 at 2 ranks differs from stage 0 in one process by 7.2e-3 and equals ZeRO-2 at
# 2 ranks bit for bit; a 10% larger lr moves the weights by 3.8e-2, which the bound catches.
LOSS_TOL = 2 * 2.0**-8
WEIGHT_TOL = 4 * 2.0**-8
TIMES: dict[str, float] = {}
DEVIATIONS: dict[str, tuple[float, float]] = {}


def launch_cmd(engine: str, nproc: int, *args: str) -> list[str]:
    if engine == "zeroshard":
        return [sys.executable, "-m", "zeroshard.cli.launch", "--as-deepspeed", "--nproc_per_node", str(nproc),
                str(SCRIPT), *args]
    # DeepSpeed's own launcher, as DeepSpeed-Chat's walkthrough starts step 1 (its default port,
    # 29500, may be taken on a shared machine).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port", str(port),
            str(SCRIPT), *args]


def start(engine: str, nproc: int, out: Path, base: Path, *args: str) -> subprocess.Popen[str]:
    """One job of the script: OUT gets its weights; BASE is the "pretrained" model it fine-tunes
    (made by the script, seeded, when BASE has no config.json)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROSHARD_AS_DEEPSPEED", "RANK", "WORLD_SIZE",
                                                           "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", ZEROSHARD_ALIAS_QUIET="1", TOKENIZERS_PARALLELISM="false")
    if engine == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".ds_build"))
    cmd = launch_cmd(engine, nproc, *COMMON, "--per_device_train_batch_size", str(GLOBAL_BATCH // nproc),
                     "--output_dir", str(out), "--model_name_or_path", str(base), *args)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen[str], label: str, t0: float) -> str:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{label}: still running after {TIMEOUT_S} s:\n{out[-6000:]}")
    TIMES[label] = time.perf_counter() - t0
    assert proc.returncode == 0, f"{label}: {' '.join(proc.args)}\n{out[-6000:]}"
    return out


def losses(output: str, nproc: int) -> list[float]:
    """Per step, the mean of the ranks' losses: every row has the same token count, so it is the
    loss of the global batch, which stage 0 in one process computes whole."""
    per_step: dict[int, dict[int, float]] = {}
    for _, step, rank, loss in LOSS_LINE.findall(output):
        per_step.setdefault(int(step), {})[int(rank)] = float(loss)
    assert per_step and all(len(r) == nproc for r in per_step.values()), output[-3000:]
    return [sum(r.values()) / nproc for _, r in sorted(per_step.items())]


def run(tmp: Path, engine: str, nproc: int, name: str, *args: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    t0 = time.perf_counter()
    out = finish(start(engine, nproc, tmp / engine / name, tmp / "base", *args), f"{engine}|{name}|{nproc}", t0)
    return losses(out, nproc), torch.load(tmp / engine / name / "pytorch_model.bin")


def deviations(a: tuple[list[float], dict[str, torch.Tensor]], b: tuple[list[float], dict[str, torch.Tensor]]
               ) -> tuple[float, float]:
    """The largest relative loss deviation over the steps, and ||w_a - w_b|| / ||w_b|| over all
    the saved weights (Note: [bf16 tolerance of the DeepSpeed-Chat cases])."""
    (la, wa), (lb, wb) = a, b
    assert len(la) == len(lb) > 0 and wa.keys() == wb.keys(), (la, lb, sorted(wa), sorted(wb))
    assert all(wa[k].shape == wb[k].shape for k in wb), "whole tensors, not shards or placeholders"
    loss_dev = max(abs(x - y) / abs(y) for x, y in zip(la, lb, strict=True))
    diff = sum(float((wa[k].float() - wb[k].float()).pow(2).sum()) for k in wb)
    norm = sum(float(wb[k].float().pow(2).sum()) for k in wb)
    return loss_dev, (diff / norm) ** 0.5


@pytest.fixture(scope="module")
def stage0(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, tuple[list[float], dict[str, torch.Tensor]]]:
    """Stage 0 in one process (the whole global batch per step), without and with LoRA: the two
    one-process jobs run side by side (one core each)."""
    tmp = tmp_path_factory.mktemp("dschat_stage0")
    t0 = time.perf_counter()
    procs = {lora: start("zeroshard", 1, tmp / f"stage0_lora{int(lora)}", tmp / f"base{int(lora)}", "--zero_stage", "0",
                         *(LORA if lora else []))
             for lora in (False, True)}
    got = {}
    for lora, proc in procs.items():
        out = finish(proc, f"zeroshard|stage0{' lora' if lora else ''}|1", t0)
        got[lora] = losses(out, 1), torch.load(tmp / f"stage0_lora{int(lora)}" / "pytorch_model.bin")
    return got


CASES = [  # (id, ranks, the script's flags)
    ("zero2_world1", 1, ["--zero_stage", "2"]),
    ("zero2_world2", 2, ["--zero_stage", "2"]),
    ("zero3_gradient_checkpointing_world2", 2, ["--zero_stage", "3", "--gradient_checkpointing"]),
    ("zero3_lora_world2", 2, ["--zero_stage", "3", *LORA]),
    ("zero2_offload_world2", 2, ["--zero_stage", "2", "--offload"]),
]


@pytest.mark.parametrize(("nproc", "args"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_dschat_step1_equals_stage0(tmp_path: Path, stage0: dict, nproc: int, args: list[str]) -> None:
    """DeepSpeed-Chat step 1 at ZeRO-2/3 (with gradient checkpointing, LoRA on partitioned weights,
    CPU offload with DeepSpeedCPUAdam) against stage 0 in one process: per-step losses and the
    saved weights within bf16's tolerance (Note: [bf16 tolerance of the DeepSpeed-Chat cases])."""
    name = " ".join(args)
    got = run(tmp_path, "zeroshard", nproc, name, *args)
    loss_dev, weight_dev = deviations(got, stage0["--lora_dim" in args])
    DEVIATIONS[f"{name}|{nproc} vs stage 0|1"] = loss_dev, weight_dev
    # The loss falls by more than the loss tolerance spans (2u * 4.6 = 0.036), so a run that
    # skipped its updates could not pass for stage 0's.
    assert got[0][-1] < got[0][0] - 0.04, f"the loss should fall: {got[0]}"
    assert loss_dev <= LOSS_TOL, (got[0], stage0["--lora_dim" in args][0])
    assert weight_dev <= WEIGHT_TOL, weight_dev


@pytest.mark.deepspeed  # opt-in: tests/run.py --deepspeed (tests/conftest.py)
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs a real DeepSpeed 0.19 (pip install -e .[bench])")
@pytest.mark.parametrize("args", [["--zero_stage", "2"], ["--zero_stage", "3", "--gradient_checkpointing"],
                                  ["--zero_stage", "3", *LORA], ["--zero_stage", "2", "--offload"]],
                         ids=["zero2", "zero3_gradient_checkpointing", "zero3_lora", "zero2_offload"])
def test_dschat_step1_equals_deepspeed_world2(tmp_path: Path, args: list[str]) -> None:
    """The same script under DeepSpeed 0.19.8's launcher and under zeroshard's, 2 ranks: the same
    per-step losses and saved weights within bf16's tolerance. Measured (DeepSpeed 0.19.8,
    transformers 4.57, CPU): loss 1.4e-4, weights 2.0e-3 at ZeRO-2, ZeRO-3 + gradient checkpointing
    and ZeRO-2 + offload; loss 2.7e-5, weights 9.1e-4 at ZeRO-3 + LoRA. DeepSpeed's first run here
    builds its CPU ops into .ds_build (about two minutes on 2 cores)."""
    name = " ".join(args)
    ours, theirs = run(tmp_path, "zeroshard", 2, name, *args), run(tmp_path, "deepspeed", 2, name, *args)
    loss_dev, weight_dev = deviations(ours, theirs)
    DEVIATIONS[f"{name}|2 vs DeepSpeed|2"] = loss_dev, weight_dev
    assert loss_dev <= LOSS_TOL and weight_dev <= WEIGHT_TOL, (loss_dev, weight_dev, ours[0], theirs[0])


def teardown_module() -> None:
    for label, seconds in TIMES.items():
        print(f"[dschat] {label}: {seconds:.1f} s")
    for label, (loss_dev, weight_dev) in DEVIATIONS.items():
        print(f"[dschat] {label}: loss {loss_dev:.2e}, weights {weight_dev:.2e}")
