"""AutoTP against DeepSpeed 0.19: per-step losses of the tiny Llama at TP 2 x DP 1 (2 ranks) and
TP 2 x DP 2 (4 ranks), ZeRO 0/1/2, clipping, save after step 3 and resume (autotp_worker.py).

Opt-in (marker `deepspeed`): `python tests/run.py deepspeed`, or
`python -m pytest tests/differential/test_autotp.py`. Records in runs/autotp/.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import conftest  # noqa: E402  the sibling modules load after the sys.path insert
from harness import ROOT, job_env  # noqa: E402  the sibling modules load after the sys.path insert

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed: pip install -e '.[bench]'", allow_module_level=True)

pytestmark = pytest.mark.deepspeed
OUT = ROOT / "runs" / "autotp"
TOL = 1e-5
STAGES = (0, 1, 2)


def _run(engine: str, world: int) -> dict[str, list[list[float]]]:
    out = OUT / f"{engine}_tp2_w{world}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(HERE / "autotp_worker.py"), "--engine", engine, "--tp", "2", "--out", str(OUT)]
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / f"{engine}_w{world}.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=job_env(), stdout=log, stderr=subprocess.STDOUT, timeout=1800, check=False)
    assert out.exists(), f"the {engine} job at {world} ranks wrote no records; see {OUT / f'{engine}_w{world}.log'}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2xdp1", "tp2xdp2"])
def records(request: pytest.FixtureRequest) -> tuple[int, dict, dict]:
    world = request.param
    return world, _run("ds", world), _run("zs", world)


@pytest.mark.parametrize("stage", STAGES)
def test_losses_match_deepspeed(records: tuple[int, dict, dict], stage: int) -> None:
    world, ds, zs = records
    d, z = ds[str(stage)], zs[str(stage)]
    # Both engines really split q_proj (32 x 32 -> 16 x 32) and see world / 2 data-parallel ranks.
    assert ds[f"layout{stage}"] == zs[f"layout{stage}"] == [[16, 32], world // 2], (ds[f"layout{stage}"],
                                                                                  zs[f"layout{stage}"])
    assert len(d) == len(z) > 0
    worst = max(abs(a - b) for rd, rz in zip(d, z) for a, b in zip(rd, rz))
    conftest.TABLE.append(f"AutoTP TP2 x DP{world // 2} ZeRO-{stage}: {len(d)} steps (save/resume after 3), "
                          f"DeepSpeed last loss {d[-1][0]:.6f}, zeroshard {z[-1][0]:.6f}, max |diff| {worst:.2e}")
    assert worst <= TOL, f"max loss difference {worst:.3e} > {TOL}"
