"""A pytest plugin for run.py: split DeepSpeed's tests into in-process ones and the ones its
`DistributedTest` harness runs in freshly started ranks (`ZS_DSUNIT_SELECT=local|dist`).

In-process tests cost milliseconds; each distributed one starts 1-4 interpreters that import
torch and deepspeed (seconds on a quiet machine, minutes on a loaded 2-core one), so a run can
measure every in-process test of the list and the distributed ones as time allows. It only
deselects: it imports nothing of DeepSpeed's or zeroshard's into the pytest process.

It also names the modules the harness's forkserver imports once (`ZS_DSUNIT_PRELOAD`, a comma-separated
list; run.py sets torch, deepspeed, deepspeed.comm and DeepSpeed's test harness `unit.common`):
DeepSpeed's `DistributedTest` starts its ranks with multiprocessing's forkserver, whose children
otherwise import torch and `deepspeed` afresh for every test (seconds per rank on a quiet machine,
half a minute on a loaded 2-core one: most of a distributed test's cost). A forked child inherits the
imported modules; the forkserver starts no process group and no thread, and both engines get the
same preload, so what runs in the ranks is unchanged.

And it makes a rank's pytest outcome come back as a failure (`RankOutcomeError`, installed into
`multiprocessing.pool` for both engines). DeepSpeed's harness runs each test's ranks as one
`Pool.starmap_async` task per rank and only `Skipped` is caught there; a rank that fails through
pytest itself (`pytest.fail`, or a `pytest.raises` that saw nothing: "DID NOT RAISE") raises
`Failed`, a BaseException, which the pool's worker does not catch: the worker process exits,
the task's result never arrives, the harness's `get(DS_UNITTEST_TIMEOUT)` gives up, and its
teardown (`pool.close(); pool.join()`) then waits forever, because a pool whose result cache
still holds the lost task never stops its worker handler. One such test ended a whole pass,
whichever engine ran it (`TestIncorectAllgatherBucketSize::test[1001]` did so for zeroshard's).
"""

from __future__ import annotations

import multiprocessing.pool
import os
from typing import Any

_STARMAPSTAR = multiprocessing.pool.starmapstar


class RankOutcomeError(Exception):
    """A rank's pytest outcome (``Failed``: ``pytest.fail``, a ``pytest.raises`` that saw
    nothing), carried back through the harness's pool as an ordinary exception so the test fails
    with that message instead of losing the pool's task (module docstring)."""


def starmapstar(args: Any) -> Any:
    """``multiprocessing.pool.starmapstar`` (what ``Pool.starmap_async`` runs in a worker), with a
    pytest outcome turned into :class:`RankOutcomeError`. Found by reference in the worker, which
    imports this module from the same ``PYTHONPATH``."""
    try:
        return _STARMAPSTAR(args)
    except (Exception, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # pytest's OutcomeException family
        raise RankOutcomeError(f"{type(e).__name__}: {e}") from None


def _is_distributed(item: Any) -> bool:
    cls = getattr(item, "cls", None)
    if cls is not None and getattr(cls, "is_dist_test", False):
        return True
    info = getattr(item, "_fixtureinfo", None)  # a DistributedFixture also starts fresh ranks
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(getattr(d.func, "is_dist_fixture", False) for group in defs for d in group)


def pytest_configure(config: Any) -> None:
    """Hand the preload list to multiprocessing before DeepSpeed's harness starts the forkserver,
    and make the harness's pool report a rank's pytest outcome (module docstring)."""
    multiprocessing.pool.starmapstar = starmapstar
    names = [n.strip() for n in os.environ.get("ZS_DSUNIT_PRELOAD", "").split(",") if n.strip()]
    if names:
        multiprocessing.set_forkserver_preload(names)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Keep the items of the selected kind (`ZS_DSUNIT_SELECT`) and, when `ZS_DSUNIT_ONLY` names a
    file of node ids (one a line: the baseline's passes), only those. Selecting by file and then
    by node id here, rather than naming node ids on the command line, keeps one module that fails
    to import from ending the whole run ("found no collectors")."""
    mode = os.environ.get("ZS_DSUNIT_SELECT", "").strip()
    only_file = os.environ.get("ZS_DSUNIT_ONLY", "").strip()
    only = None
    if only_file:
        with open(only_file) as f:
            only = set(f.read().split())
    keep = [i for i in items if (mode not in ("local", "dist") or _is_distributed(i) == (mode == "dist"))
            and (only is None or i.nodeid in only)]
    dropped = [i for i in items if i not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
