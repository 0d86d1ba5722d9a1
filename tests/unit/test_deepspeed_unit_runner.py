"""tests/deepspeed_unit's pytest plugin: a rank's pytest outcome comes back through DeepSpeed's
harness pool as a failure instead of losing the pool's task (which hung the whole pass)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deepspeed_unit"))
import zs_select  # the runner's plugin lives outside the package tree


def _rank_did_not_raise() -> None:
    with pytest.raises(AssertionError):
        pass  # "DID NOT RAISE": pytest's Failed, a BaseException


def _rank_ok() -> int:
    return 7


def test_outcome_becomes_an_exception_in_the_worker_function() -> None:
    with pytest.raises(zs_select.RankOutcomeError, match="Failed: DID NOT RAISE"):
        zs_select.starmapstar((_rank_did_not_raise, [()]))
    assert zs_select.starmapstar((_rank_ok, [(), ()])) == [7, 7]
    with pytest.raises(ZeroDivisionError):  # ordinary exceptions pass through unchanged
        zs_select.starmapstar((divmod, [(1, 0)]))


def test_pool_reports_a_rank_outcome_and_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    """What DeepSpeed's harness does per test: starmap_async, get(timeout), close, join. Without
    the plugin the worker dies on Failed, get() times out and join() never returns."""
    monkeypatch.setattr(multiprocessing.pool, "starmapstar", multiprocessing.pool.starmapstar)
    zs_select.pytest_configure(None)  # installs the pool wrapper (and no preload: none named)
    pool = multiprocessing.get_context("fork").Pool(1)
    try:
        result = pool.starmap_async(_rank_did_not_raise, [()])
        with pytest.raises(zs_select.RankOutcomeError, match="DID NOT RAISE"):
            result.get(60)
    finally:
        pool.close()
        joiner = threading.Thread(target=pool.join, daemon=True)
        joiner.start()
        joiner.join(60)
    assert not joiner.is_alive(), "the pool's join() hung after a rank's pytest outcome"
