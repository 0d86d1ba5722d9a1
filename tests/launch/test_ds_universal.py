"""DeepSpeed universal checkpoints, both ways (issue 42 item 6).

- `zeroshard to-deepspeed` turns a zeroshard checkpoint (saved by 2 ranks at ZeRO 1, 2, 3, fp32
  and bf16, one and two parameter groups) into DeepSpeed's universal layout; zeroshard resumes
  from it at 1 and 3 ranks into other stages and continues with the losses of the uninterrupted
  zeroshard run (scripts/zs_universal_gen.py, scripts/ds_ckpt_load.py). Bad input is refused by
  name: an existing output, a conversion missing a parameter's file.
- Opt-in (`deepspeed` marker, real DeepSpeed 0.19.8): DeepSpeed resumes from that export at 2
  ranks (the saved world size) into ZeRO 1, 2 and 3 and at 1 rank, and continues with zeroshard's
  losses (scripts/ds_universal_load.py); DeepSpeed's own `ds_to_universal` output of its saves
  loads into zeroshard at 1 and 3 ranks and continues with DeepSpeed's losses
  (scripts/ds_universal_gen.py).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_cmd import job_env, python_or_torchrun, torchrun

from zeroshard.checkpoint.ds_universal import find_universal, read_universal_layout
from zeroshard.checkpoint_format import Manifest
from zeroshard.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "scripts"
ZS_CASES = ["s1-fp32-groups", "s2-fp32", "s3-fp32", "s3-bf16"]
DS_CASES = ["s1-fp32-groups", "s2-fp32", "s3-fp32", "s2-bf16"]
NO_DEEPSPEED = importlib.util.find_spec("deepspeed") is None


def _env() -> dict[str, str]:
    return job_env(ROOT, deepspeed=True)


def _run(nproc: int, script: str, *args: str, timeout_s: int = 900) -> str:
    # DeepSpeed's init_distributed wants torchrun's environment even at 1 rank (else it tries MPI).
    start = torchrun if script.startswith("ds_universal") else python_or_torchrun
    cmd = start(nproc, str(SCRIPTS / script), *args, rank0_output=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=timeout_s, check=False)
    assert proc.returncode == 0, f"{script} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    return proc.stdout


def _to_deepspeed(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zeroshard.cli.main", "to-deepspeed", *args], cwd=ROOT, env=_env(),
                          text=True, capture_output=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """zeroshard saves at 2 ranks, each converted by `zeroshard to-deepspeed` into <case>-uc."""
    root = tmp_path_factory.mktemp("zs_universal")
    out = _run(2, "zs_universal_gen.py", str(root), *ZS_CASES)
    for case in ZS_CASES:
        assert f"ZS CASE OK {case}" in out, out[-3000:]
        done = _to_deepspeed(str(root / case), str(root / f"{case}-uc"))
        assert done.returncode == 0, done.stderr
        assert re.search(r"wrote .*global_step3: 25 trained and 1 frozen parameters", done.stdout), done.stdout
    return root


def _check(out: str, prefix: str, cases: list[str], stages: list[int], world: int) -> None:
    for case in cases:
        for stage in stages:
            pattern = rf"{prefix} OK {re.escape(case)} -> stage {stage} world {world}: max \|dloss\| \S+"
            assert re.search(pattern, out), f"{case} -> stage {stage} world {world}:\n{out[-4000:]}"


def test_zeroshard_resumes_its_export_at_other_sizes(exported: Path) -> None:
    cases = [f"{c}-uc" for c in ZS_CASES]
    _check(_run(1, "ds_ckpt_load.py", str(exported), "0,3", *cases), "DSLOAD", cases, [0, 3], 1)
    _check(_run(3, "ds_ckpt_load.py", str(exported), "1,2", *cases), "DSLOAD", cases, [1, 2], 3)


def test_bad_conversions_are_refused_by_name(exported: Path, tmp_path: Path) -> None:
    again = _to_deepspeed(str(exported / "s2-fp32"), str(exported / "s2-fp32-uc"))
    assert again.returncode == 1 and "global_step3: exists" in again.stderr and "nothing is overwritten" in again.stderr
    bare = _to_deepspeed(str(tmp_path / "nothing-here"), str(tmp_path / "out"))
    assert bare.returncode == 1 and "zeroshard to-deepspeed:" in bare.stderr
    broken = tmp_path / "broken"
    shutil.copytree(exported / "s2-fp32-uc", broken)
    (broken / "global_step3" / "zero" / "blocks.0.mlp.0.weight" / "fp32.pt").unlink()
    hint = Manifest(world_size=1, zero_stage=0, precision="fp32", params=[], aliases={}, buffers=[], optimizer=None,
                    param_groups=0, fragments=[[]], weight_pieces=None)
    with pytest.raises(CheckpointError, match=r"zero/blocks\.0\.mlp\.0\.weight/fp32\.pt: missing"):
        read_universal_layout(broken / "global_step3", hint)


def test_latest_universal_is_found_as_deepspeed_reads_it(tmp_path: Path) -> None:
    tag = tmp_path / "global_step7"
    (tag / "zero").mkdir(parents=True)
    (tag / "zero" / "optimizer_state.pt").write_bytes(b"x")
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    assert find_universal(tmp_path, None) is None  # no latest_universal
    (tmp_path / "latest_universal").write_text("global_step7")
    assert find_universal(tmp_path, None) == tag
    (tmp_path / "latest").write_text("global_step9")  # a zeroshard save in the same directory wins ...
    assert find_universal(tmp_path, None) is None
    assert find_universal(tmp_path, None, prefer=True) == tag  # ... unless checkpoint.load_universal
    assert find_universal(tmp_path, "global_step7") == tag
    (tag / "zero" / "optimizer_state.pt").unlink()
    assert find_universal(tmp_path, "global_step7") is None


@pytest.fixture(scope="module")
def ds_universal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ds_universal")
    out = _run(2, "ds_universal_gen.py", str(root), *DS_CASES, timeout_s=1500)
    for case in DS_CASES:
        assert f"DS UC OK {case}" in out, out[-4000:]
    return root


@pytest.mark.deepspeed
@pytest.mark.skipif(NO_DEEPSPEED, reason="DeepSpeed is not installed (optional: pip install deepspeed==0.19.8)")
def test_deepspeed_resumes_zeroshard_export(exported: Path) -> None:
    plain = [f"{c}-uc" for c in ZS_CASES if not c.endswith("-groups")]
    # DeepSpeed's ZeRO-3 universal loader gives every group the first group's hyperparameters
    # (docs/deepspeed-differences.md), so the two-group case is checked at ZeRO 1 and 2.
    _check(_run(2, "ds_universal_load.py", str(exported), "1,2,3", *plain), "DSUC", plain, [1, 2, 3], 2)
    _check(_run(2, "ds_universal_load.py", str(exported), "1,2", "s1-fp32-groups-uc"), "DSUC",
           ["s1-fp32-groups-uc"], [1, 2], 2)
    _check(_run(1, "ds_universal_load.py", str(exported), "3", *plain), "DSUC", plain, [3], 1)


@pytest.mark.deepspeed
@pytest.mark.skipif(NO_DEEPSPEED, reason="DeepSpeed is not installed (optional: pip install deepspeed==0.19.8)")
def test_zeroshard_resumes_deepspeed_universal(ds_universal: Path) -> None:
    cases = [f"{c}-uc" for c in DS_CASES]
    _check(_run(1, "ds_ckpt_load.py", str(ds_universal), "0,3", *cases), "DSLOAD", cases, [0, 3], 1)
    _check(_run(3, "ds_ckpt_load.py", str(ds_universal), "1,2", *cases), "DSLOAD", cases, [1, 2], 3)
