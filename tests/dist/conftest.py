"""One process group per test run, shared by every test under tests/dist.

Run: ``torchrun --standalone --nproc-per-node=2 -m pytest tests/dist -x -q`` (also 3 ranks).
Plain ``pytest tests/dist`` runs the same tests at world size 1 without a group. Every rank
runs the same tests in the same order; skips must never depend on the rank.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

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


@pytest.fixture
def shared_dir(comm: Comm, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh directory every rank sees under the same name (rank 0 draws it), removed after the test.

    The name carries the test module's name so a leftover directory says which test left it.
    """
    token = torch.tensor([int.from_bytes(os.urandom(4), "little") >> 1 if comm.rank == 0 else 0])
    comm.broadcast(token, src=0)
    module = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    path = Path(tempfile.gettempdir()) / f"zeroshard-{module}-{int(token.item())}"
    yield path
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """Every object alive before the test moved out of the garbage collector's view (gc.freeze) for
    the test's length. A CPU memory census (runtime/monitor.py's `allocated_bytes`) walks every object
    the collector tracks; after a few hundred tests with transformers imported that walk took ~10 s
    per census. The census tests measure differences from a baseline taken inside the test, which
    the frozen objects cannot enter, so the numbers are the same and the walk covers the test's own."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
