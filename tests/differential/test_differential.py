"""Differential suite: every case of cases.py through DeepSpeed 0.19 and zeroshard, compared.

Opt-in: `python tests/run.py deepspeed` (or `python -m pytest tests/differential`). Skipped,
saying why, where DeepSpeed is not installed. The two 2-rank jobs run once per session (about
10 minutes on a loaded 2-core box; records in runs/differential/); each case is then one test,
so the counts say how many match.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import conftest  # noqa: E402  the sibling modules load after the sys.path insert
from cases import CASES, Case  # noqa: E402  the sibling modules load after the sys.path insert
from compare import Result, table  # noqa: E402  the sibling modules load after the sys.path insert

if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("DeepSpeed is not installed: pip install -e '.[bench]'", allow_module_level=True)


@pytest.fixture(scope="module")
def results() -> dict[str, Result]:
    import harness

    # Kept after the run (runs/ is git-ignored): `harness.py --reuse` re-renders the table.
    out = harness.ROOT / "runs" / "differential"
    for old in out.glob("*.json*"):
        old.unlink()
    found, times = harness.run(out, CASES)
    timing = ", ".join(f"{k} job {v:.0f} s" for k, v in times.items())
    conftest.TABLE.append(table(found) + f"\n{timing}; records and logs in {out}")
    return {r.case.name: r for r in found}


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
def test_matches_deepspeed(case: Case, results: dict[str, Result]) -> None:
    r = results[case.name]
    if case.xfail:
        assert not r.ok, f"{case.name} now matches DeepSpeed: remove its xfail ({case.xfail})"
        pytest.xfail(case.xfail)
    assert r.ok, f"{case.name} deviates from DeepSpeed:\n  " + "\n  ".join(r.problems)
