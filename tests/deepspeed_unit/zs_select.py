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
"""

from __future__ import annotations

import os
from typing import Any


def _is_distributed(item: Any) -> bool:
    cls = getattr(item, "cls", None)
    if cls is not None and getattr(cls, "is_dist_test", False):
        return True
    info = getattr(item, "_fixtureinfo", None)  # a DistributedFixture also starts fresh ranks
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(getattr(d.func, "is_dist_fixture", False) for group in defs for d in group)


def pytest_configure(config: Any) -> None:
    """Hand the preload list to multiprocessing before DeepSpeed's harness starts the forkserver."""
    names = [n.strip() for n in os.environ.get("ZS_DSUNIT_PRELOAD", "").split(",") if n.strip()]
    if names:
        import multiprocessing

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
