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
        _write({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome})
