"""Print the differential table at the end of the pytest run (test_differential.py fills it)."""

from __future__ import annotations

from typing import Any

TABLE: list[str] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for text in TABLE:
        terminalreporter.write_sep("=", "zeroshard vs DeepSpeed 0.19 (differential)")
        terminalreporter.write_line(text)
