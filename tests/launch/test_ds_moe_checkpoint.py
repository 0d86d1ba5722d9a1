"""DeepSpeed 0.19.8's legacy MoE checkpoints load into zeroshard at another expert layout (issue 40
item 5): real DeepSpeed saves tests/differential/moe_worker.py's model (4 experts, top-1 with
dropped routes) at 2 ranks and ep_size 2, at ZeRO 0, 1 and 2 in fp32 and ZeRO 0 and 2 in bf16,
then continues 2 steps (scripts/ds_moe_ckpt.py gen). zeroshard loads each with optimizer state
at 2 ranks ep 2 ZeRO 0 and 1, 2 ranks ep 1 ZeRO 2 and 1 rank ep 1 ZeRO 1, continues the same 2
steps on the same samples and must give DeepSpeed's losses and final weights (fp32 1e-5 relative;
bf16 see ds_moe_ckpt.TOL). Also: the variants zeroshard does not map are refused by name.

Opt-in (marker `deepspeed`; `python tests/run.py --deepspeed`, DeepSpeed 0.19.8 installed).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torchrun_cmd import collect_jobs, job_env, torchrun

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "ds_moe_ckpt.py"
CASES = ["s0-fp32", "s1-fp32", "s2-fp32", "s0-bf16", "s2-bf16"]
LOADS = {  # (world, ep, stage) -> cases
    (2, 2, 1): CASES, (2, 2, 0): ["s0-fp32", "s2-fp32", "s0-bf16", "s2-bf16"], (2, 1, 2): CASES,
    (1, 1, 1): CASES}

pytestmark = [pytest.mark.deepspeed,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="DeepSpeed is not installed (optional: pip install deepspeed==0.19.8)")]


def _start(nproc: int, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(torchrun(nproc, str(SCRIPT), *args, rank0_output=True), cwd=ROOT,
                            env=job_env(ROOT, deepspeed=True), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("ds_moe")
    code, out, _ = collect_jobs({"gen": _start(2, "gen", str(root), *CASES)}, 900, time.monotonic())["gen"]
    assert code == 0, out[-6000:]
    for case in CASES:
        assert f"DSMOE GEN OK {case}" in out, out[-4000:]
    yield root


def test_continues_as_deepspeed_at_other_layouts(saved: Path) -> None:
    start = time.monotonic()
    jobs = {key: _start(key[0], "load", str(saved), str(key[1]), str(key[2]), *cases)
            for key, cases in LOADS.items()}
    results = collect_jobs({str(k): p for k, p in jobs.items()}, 900, start)
    for (world, ep, stage), cases in LOADS.items():
        code, out, _ = results[str((world, ep, stage))]
        print("\n".join(line for line in out.splitlines() if line.startswith("DSMOE")))
        assert code == 0, out[-6000:]
        for case in cases:
            assert re.search(rf"DSMOE OK {case} -> world {world} ep {ep} stage {stage}: ", out), out[-4000:]


def _copy(saved: Path, case: str, dst: Path) -> Path:
    shutil.copytree(saved / case, dst)
    return dst / "global_step2"


def _edit_model_file(tag: Path, **changes: object) -> None:
    path = tag / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=False)
    torch.save({**state, **changes}, path)


def test_unmapped_variants_are_refused_by_name(saved: Path, tmp_path: Path) -> None:
    from zeroshard.checkpoint.ds_import import read_layout
    from zeroshard.errors import CheckpointError

    tag = _copy(saved, "s2-fp32", tmp_path / "autoep")
    _edit_model_file(tag, ds_autoep_layers=[{"moe_layer_id": 0}])
    with pytest.raises(CheckpointError, match="AutoEP"):
        read_layout(tag, None)
    tag = _copy(saved, "s2-fp32", tmp_path / "missing")
    (tag / "layer_0_expert_3_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"experts per MoE layer.*missing"):
        read_layout(tag, None)
    tag = _copy(saved, "s0-fp32", tmp_path / "old")
    (tag / "layer_0_expert_0_mp_rank_00_model_states.pt").rename(tag / "expert_0_mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match="without a layer id"):
        read_layout(tag, None)
