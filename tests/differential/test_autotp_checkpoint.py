"""DeepSpeed 0.19's AutoTP checkpoint loads into zeroshard (checkpoint/ds_autotp.py): DeepSpeed trains
the tiny Llama at TP 2 x DP 1 (2 ranks) and TP 2 x DP 2 (4 ranks), ZeRO 0/1/2, for 2 steps, saves,
and continues 2 steps; zeroshard loads DeepSpeed's files at TP 2 (the save's layout) and at TP 1 x
DP 2, runs the same 2 steps, and its losses equal DeepSpeed's continuation (fp32, 1e-5).

Opt-in (marker `deepspeed`): `python -m pytest tests/differential/test_autotp_checkpoint.py`.
Records in runs/autotp_ckpt/.
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
OUT = ROOT / "runs" / "autotp_ckpt"
TOL = 1e-5
STAGES = ("0", "1", "2")


def _run(engine: str, world: int, tp: int, save_dp: int) -> dict[str, list[float]]:
    name = f"{engine}_save-dp{save_dp}_tp{tp}_w{world}"
    out = OUT / f"{name}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(HERE / "autotp_ckpt_worker.py"), "--engine", engine, "--tp", str(tp), "--save-dp", str(save_dp),
           "--ckpt", str(OUT / f"ckpt_dp{save_dp}"), "--out", str(out)]
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / f"{name}.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=job_env(), stdout=log, stderr=subprocess.STDOUT, timeout=1800, check=False)
    assert out.exists(), f"the {engine} job wrote no records; see {OUT / f'{name}.log'}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module", params=[1, 2], ids=["saved-tp2xdp1", "saved-tp2xdp2"])
def saved(request: pytest.FixtureRequest) -> tuple[int, dict[str, list[float]]]:
    save_dp = request.param
    return save_dp, _run("ds", 2 * save_dp, 2, save_dp)


@pytest.mark.parametrize("tp", [2, 1], ids=["load-tp2", "load-tp1xdp2"])
def test_zeroshard_continues_deepspeed_autotp_checkpoint(saved: tuple[int, dict], tp: int) -> None:
    save_dp, ds = saved
    world = 2 * save_dp if tp == 2 else 2
    zs = _run("zs", world, tp, save_dp)
    for stage in STAGES:
        d, z = ds[stage], zs[stage]
        assert len(d) == len(z) == 2
        worst = max(abs(a - b) for a, b in zip(d, z, strict=True))
        conftest.TABLE.append(f"AutoTP checkpoint TP2 x DP{save_dp} ZeRO-{stage} -> zeroshard TP{tp} x "
                              f"DP{world // tp}: DeepSpeed {d}, zeroshard {z}, max |diff| {worst:.2e}")
        assert worst <= TOL, f"ZeRO-{stage}: max loss difference {worst:.3e} > {TOL}"
