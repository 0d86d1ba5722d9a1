"""A DeepSpeed 0.19 pipeline checkpoint loads into zeroshard and continues with DeepSpeed's numbers
(opt-in, marker `deepspeed`: `python tests/run.py deepspeed`).

DeepSpeed trains a tied 6-layer model at 2 stages (ZeRO-0 and ZeRO-1; x DP 1 at 2 ranks, x DP 2 at
4) and saves after 2 steps; DeepSpeed then loads its own checkpoint and continues (its
continuation), and zeroshard loads the same files at 2 stages and at another stage count (1 at 2
ranks, i.e. DP 2; 4 at 4 ranks) and continues. zeroshard's continued losses equal DeepSpeed's
within 1e-5 relative (DeepSpeed itself refuses a load at another stage or DP degree, as issue 26 measured).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness import job_env  # noqa: E402  the sibling modules load after the sys.path insert
from pipe_worker import RESUME_CASES, SAVE_AT  # noqa: E402  the sibling modules load after the sys.path insert

pytestmark = pytest.mark.deepspeed

WORLDS = {2: (2, 1), 4: (2, 4)}
"""World size -> the stage counts zeroshard loads at."""


def _job(out: Path, name: str, world: int, *args: str) -> dict[str, object]:
    path = out / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(HERE / "pipe_worker.py"), "--out", str(path), "--cases", *RESUME_CASES, *args]
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(cmd, env=job_env(), stdout=log, stderr=subprocess.STDOUT, timeout=1800, check=False)
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    got: dict[str, dict[str, object]] = {}
    for world, loads in WORLDS.items():
        out = tmp_path_factory.mktemp(f"pipe-ckpt-{world}")
        ckpts = out / "ckpt"
        got[f"ds-whole-{world}"] = _job(out, "ds-whole", world, "--engine", "ds", "--save", str(ckpts))
        got[f"ds-resume-{world}"] = _job(out, "ds-resume", world, "--engine", "ds", "--load", str(ckpts))
        for stages in loads:
            got[f"zs-pp{stages}-{world}"] = _job(out, f"zs-pp{stages}", world, "--engine", "zs", "--load", str(ckpts),
                                                 "--stages", str(stages))
    rows = ["case | zeroshard load at | max deviation from DeepSpeed's continuation (relative)"]
    for world, loads in WORLDS.items():
        for case in RESUME_CASES:
            ds = got[f"ds-resume-{world}"].get(case)
            for stages in loads:
                zs = got[f"zs-pp{stages}-{world}"].get(case)
                dev = (f"{max(abs(a - b) / abs(a) for a, b in zip(ds, zs)):.1e}"
                       if isinstance(ds, list) and isinstance(zs, list) else f"ds: {ds!s:.80} / zs: {zs!s:.80}")
                rows.append(f"{case} x dp{world // 2} | pp{stages} x dp{world // stages} | {dev}")
    print("\n".join(rows))
    return got


@pytest.mark.parametrize("world", list(WORLDS))
@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_deepspeed_pipeline_checkpoint_continues_in_zeroshard(results: dict[str, dict[str, object]], world: int,
                                                               case: str) -> None:
    whole, resumed = results[f"ds-whole-{world}"].get(case), results[f"ds-resume-{world}"].get(case)
    assert isinstance(whole, list) and isinstance(resumed, list), f"DeepSpeed failed: {whole} / {resumed}"
    assert len(resumed) == len(whole) - SAVE_AT
    for stages in WORLDS[world]:
        zs = results[f"zs-pp{stages}-{world}"].get(case)
        assert isinstance(zs, list), f"zeroshard at {stages} stages failed: {zs}"
        worst = max(abs(a - b) / abs(a) for a, b in zip(resumed, zs, strict=True))
        assert worst <= 1e-5, f"{case} at {stages} stages: {zs} vs DeepSpeed's continuation {resumed}"
        ahead = max(abs(a - b) / abs(a) for a, b in zip(whole[SAVE_AT:], zs, strict=True))
        assert ahead <= 1e-5, f"{case} at {stages} stages: {zs} vs DeepSpeed's uninterrupted run {whole}"
