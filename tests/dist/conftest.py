"""One process group per test run, shared by every test under tests/dist.

Run: ``torchrun --standalone --nproc-per-node=2 -m pytest tests/dist -x -q`` (also 3 ranks).
Plain ``pytest tests/dist`` runs the same tests at world size 1 without a group. Every rank
runs the same tests in the same order; skips must never depend on the rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from zeroshard.comm import Comm, ProcessGroups, destroy_distributed, init_distributed


@pytest.fixture(scope="package", autouse=True)
def groups() -> Iterator[ProcessGroups]:
    """The job's ProcessGroups (gloo on CPU), with a 60 s timeout so a hang fails the run."""
    groups = init_distributed(timeout_s=60)
    yield groups
    destroy_distributed()


@pytest.fixture(scope="package")
def comm(groups: ProcessGroups) -> Comm:
    """A Comm on the data-parallel group, without a comm log."""
    return Comm(groups)
