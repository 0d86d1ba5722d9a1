"""DeepSpeed's legacy MoE layer against DeepSpeed 0.19.8: per-step losses of every rank and the final
weights of every rank, at EP 1 and EP 2 (2 ranks), ZeRO 0/1/2, top-1 with dropped routes and top-2
residual, clipping, a save after step 2 resumed in a fresh engine (moe_worker.py).

Opt-in (marker `deepspeed`): `python tests/run.py deepspeed`, or
`ZEROSHARD_DEEPSPEED_TESTS=1 python -m pytest tests/differential/test_moe_differential.py`.
Records in runs/moe/.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import conftest  # noqa: E402  the sibling modules load after the sys.path insert
from harness import ROOT, run_worker  # noqa: E402  the sibling modules load after the sys.path insert

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed: pip install -e '.[bench]'", allow_module_level=True)

pytestmark = pytest.mark.deepspeed
OUT = ROOT / "runs" / "moe"
TOL = 1e-5
KEYS = [f"{case}-ep{ep}-zero{stage}" for ep in (1, 2) for case in ("top1_drop", "top2_residual") for stage in (0, 1, 2)]


@pytest.fixture(scope="module")
def records() -> tuple[dict, dict]:
    return run_worker("moe_worker.py", "ds", OUT), run_worker("moe_worker.py", "zs", OUT)


@pytest.mark.parametrize("key", KEYS)
def test_moe_matches_deepspeed(records: tuple[dict, dict], key: str) -> None:
    ds, zs = records
    d, z = ds[key], zs[key]
    assert len(d) == len(z) > 0
    loss = max(abs(a - b) / abs(a) for rd, rz in zip(d, z) for a, b in zip(rd, rz))
    weights = 0.0
    for rank in range(2):
        a = torch.load(OUT / f"ds_{key}_rank{rank}.pt")
        b = torch.load(OUT / f"zs_{key}_rank{rank}.pt")
        assert a.keys() == b.keys()
        weights = max(weights, max(((a[n] - b[n]).abs().max() / a[n].abs().max().clamp_min(1e-3)).item() for n in a))
    conftest.TABLE.append(f"MoE {key}: {len(d)} steps (save/resume after 2), max loss rel {loss:.1e}, "
                          f"max weight rel {weights:.1e}")
    assert loss <= TOL and weights <= TOL, (loss, weights)
