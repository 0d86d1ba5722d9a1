"""DeepSpeed 0.19 checkpoints load into zeroshard at any world size and stage (issue 17).

Real DeepSpeed (optional: skipped when it is not installed) writes checkpoints of a tiny GPT at 2
ranks, for every stage and precision and with CPU offload (scripts/ds_ckpt_gen.py), and records
the losses of continuing 4 steps. zeroshard loads each at 1, 2 and 3 ranks, into the saved stage
(world 2) and into every stage (worlds 1 and 3), continues the same 4 global batches and must get
DeepSpeed's losses (scripts/ds_ckpt_load.py: fp32 1e-5, bf16 and fp16 2e-3; DeepSpeed's stage-0
fp16 1e-2, see TOL_STAGE0_FP16). The checkpoints
are generated once per session. Also: unmappable layouts are refused naming the file, and
to-fp32 gives what DeepSpeed's own zero_to_fp32 gives, bit for bit.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torchrun_cmd import job_env, python_or_torchrun

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "scripts"
CASES = ([f"s{s}-{p}" for s in range(4) for p in ("fp32", "bf16", "fp16")]
         + ["s2-fp32-offload", "s3-bf16-offload", "s1-bf16-acc32", "s0-fp32-groups", "s2-bf16-groups",
            "s3-fp32-groups", "s3-bf16-sub"])

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="DeepSpeed is not installed (optional: pip install deepspeed==0.19.8)")


def _env() -> dict[str, str]:
    return job_env(ROOT, deepspeed=True)


def _start(nproc: int, script: str, *args: str) -> subprocess.Popen[str]:
    cmd = python_or_torchrun(nproc, str(SCRIPTS / script), *args, rank0_output=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen[str], what: str, timeout_s: int = 900) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    if proc.returncode != 0:
        raise AssertionError(f"{what} exited {proc.returncode}:\n{out[-6000:]}")
    return out


@pytest.fixture(scope="session")
def ds_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("ds_ckpts")
    out = _finish(_start(2, "ds_ckpt_gen.py", str(root), *CASES), "DeepSpeed at world 2", timeout_s=1500)
    for case in CASES:
        assert f"DS CASE OK {case}" in out, out[-4000:]
    yield root


def _check(out: str, cases: list[str], stages: list[int] | None, world: int) -> None:
    for case in cases:
        for stage in stages if stages is not None else [int(case[1])]:
            pattern = rf"DSLOAD OK {re.escape(case)} -> stage {stage} world {world}: max \|dloss\| \S+"
            assert re.search(pattern, out), f"{case} -> stage {stage} world {world}:\n{out[-4000:]}"


def test_continue_at_world_1_2_3(ds_checkpoints: Path) -> None:
    # World 2 into the saved stage, worlds 1 and 3 into every stage; the three jobs run together.
    jobs = {2: _start(2, "ds_ckpt_load.py", str(ds_checkpoints), "same", *CASES),
            1: _start(1, "ds_ckpt_load.py", str(ds_checkpoints), "0,1,2,3", *CASES),
            3: _start(3, "ds_ckpt_load.py", str(ds_checkpoints), "0,1,2,3", *CASES)}
    for world, proc in jobs.items():
        out = _finish(proc, f"zeroshard at world {world}")
        print("\n".join(line for line in out.splitlines() if line.startswith("DSLOAD")))
        _check(out, CASES, None if world == 2 else [0, 1, 2, 3], world)


@pytest.mark.parametrize("case", ["s1-fp32", "s3-bf16"])
def test_unmappable_is_refused_and_engine_stays_usable(ds_checkpoints: Path, case: str) -> None:
    out = _finish(_start(2, "ds_ckpt_load.py", str(ds_checkpoints), "refuse", case), "refusal at world 2")
    assert f"DSREFUSE OK {case} world 2" in out, out[-4000:]


def test_to_fp32_matches_deepspeeds_zero_to_fp32(ds_checkpoints: Path, tmp_path: Path) -> None:
    from zeroshard.checkpoint import get_fp32_state_dict_from_zero_checkpoint

    ds = pytest.importorskip("deepspeed.utils.zero_to_fp32")
    for case in CASES:
        ours = get_fp32_state_dict_from_zero_checkpoint(ds_checkpoints / case)
        assert all(t.dtype == torch.float32 for t in ours.values())
        if case.startswith("s0") or case.endswith("-acc32"):
            # DeepSpeed's zero_to_fp32 reads neither stage 0 nor BF16_Optimizer files: check the
            # masters against the saved 16-bit weights, which DeepSpeed copies from them.
            module = torch.load(next((ds_checkpoints / case).glob("global_step*/mp_rank_00_model_states.pt")),
                                weights_only=True, mmap=True)["module"]
            for name, t in module.items():
                assert torch.equal(ours[name].to(t.dtype), t), (case, name)
            continue
        theirs = ds.get_fp32_state_dict_from_zero_checkpoint(str(ds_checkpoints / case))
        assert set(theirs) <= set(ours), (case, sorted(set(theirs) - set(ours)))
        for name, t in theirs.items():
            assert torch.equal(ours[name], t.float()), (case, name)
    # The command line streams the same tensors to a safetensors file.
    target = tmp_path / "model.safetensors"
    subprocess.run([sys.executable, "-m", "zeroshard.cli.main", "to-fp32", str(ds_checkpoints / "s3-bf16"),
                    str(target), "--safetensors"], check=True, cwd=ROOT, env=_env(), timeout=300)
    from safetensors.torch import load_file

    loaded = load_file(str(target))
    ours = get_fp32_state_dict_from_zero_checkpoint(ds_checkpoints / "s3-bf16")
    assert set(loaded) == set(ours) and all(torch.equal(loaded[k], ours[k]) for k in ours)
