"""Hooks shared by every test directory.

With ZEROSHARD_TEST_LOG set (tests/run.py sets it), rank 0 appends one JSON line per test
phase to that file: which test started, and each phase's outcome. The runner reads it to
restart a distributed stage after the failing test and to count every test exactly once.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

_LOG = os.environ.get("ZEROSHARD_TEST_LOG")
_RANK0 = os.environ.get("RANK", "0") == "0"


def _write(record: dict[str, Any]) -> None:
    if _LOG and _RANK0:
        with open(_LOG, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _write({"start": nodeid})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        _write({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                "seconds": round(report.duration, 2)})


# Note: [DeepSpeed comparison tests are opt-in] Tests that run a real DeepSpeed 0.19 next to
# zeroshard (marked `deepspeed`) cost minutes each on 2 cores (DeepSpeed JIT-builds its CPU ops,
# then every case runs twice). They run in `python tests/run.py --deepspeed` (or the `deepspeed`
# stage alone), which sets ZEROSHARD_DEEPSPEED_TESTS=1; the default suite lists them as skipped
# with that command as the reason. DeepSpeed is a reference, never a dependency of zeroshard.
DEEPSPEED_TESTS = os.environ.get("ZEROSHARD_DEEPSPEED_TESTS") == "1"
DEEPSPEED_FILES = ("test_deepspeed_examples.py", "test_deepspeed_example.py", "test_ds_checkpoint.py")


# Note: [benchmark smoke runs are opt-in] tests/launch/test_gpu_bench_harness.py runs the GPU
# benchmark's harness end to end on a CPU (three torchrun jobs, a 400 s budget on 2 cores): it
# checks bench/gpu/run.py's plumbing, not zeroshard, so it runs in the `bench` stage
# (`python tests/run.py bench`, which sets ZEROSHARD_BENCH_TESTS=1), not in the default suite;
# so does tests/launch/test_moe_traffic_bench.py (bench/moe_traffic.py's smallest size, two jobs).
BENCH_TESTS = os.environ.get("ZEROSHARD_BENCH_TESTS") == "1"
BENCH_FILES = ("test_gpu_bench_harness.py", "test_moe_traffic_bench.py")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers",
                            "deepspeed: compares with a real DeepSpeed 0.19 (opt-in: tests/run.py --deepspeed)")
    config.addinivalue_line("markers", "bench: a benchmark harness's smoke run (opt-in: tests/run.py bench)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="runs a real DeepSpeed 0.19 beside zeroshard: opt-in, "
                                   "`python tests/run.py --deepspeed` (needs pip install -e .[bench])")
    skip_bench = pytest.mark.skip(reason="a benchmark harness's smoke run (minutes): opt-in, "
                                         "`python tests/run.py bench`")
    for item in items:
        if item.fspath.basename in DEEPSPEED_FILES:
            item.add_marker(pytest.mark.deepspeed)
        if "deepspeed" in item.keywords and not DEEPSPEED_TESTS:
            item.add_marker(skip)
        if item.fspath.basename in BENCH_FILES:
            item.add_marker(pytest.mark.bench)
        if "bench" in item.keywords and not BENCH_TESTS:
            item.add_marker(skip_bench)


@pytest.fixture
def deepspeed_alias(monkeypatch: pytest.MonkeyPatch) -> Any:
    """`import deepspeed` served by zeroshard's alias for one test, as ZEROSHARD_AS_DEEPSPEED=1 serves it to a
    script; undone afterwards, so a real DeepSpeed (where installed) is what the next test imports.

    The alias package is never imported by its file path (zeroshard.compat.alias.deepspeed...): its modules
    import `deepspeed` themselves, which without the alias active is a real DeepSpeed or nothing."""
    import importlib
    import sys

    from zeroshard import compat

    def ours(name: str) -> bool:
        return name == "deepspeed" or name.startswith("deepspeed.")

    saved = {name: module for name, module in sys.modules.items() if ours(name)}
    for name in saved:
        del sys.modules[name]
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv(compat.ENV_VAR, "1")  # install() sets it too; monkeypatch restores the old value
    monkeypatch.setenv("ZEROSHARD_ALIAS_QUIET", "1")
    compat.install()
    yield importlib.import_module("deepspeed")
    for name in [name for name in sys.modules if ours(name)]:
        del sys.modules[name]
    sys.modules.update(saved)
    importlib.invalidate_caches()
