"""Checkpoint steps every rank takes together: `agree` (all return or all raise CheckpointError,
over comm/agreement.py's primitive), `read_agreed` (a rank's read, then that agreement) and the
reads taken one local rank at a time (Note: [reads in turn]). The writer (save.py) and every
reader (load.py, pipe_files.py, ds_import.py, ...) import them from here.
Imports torch, comm and errors only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, TypeVar

import torch

from zeroshard.comm.agreement import raise_together
from zeroshard.errors import CheckpointError

if TYPE_CHECKING:
    from zeroshard.comm import Comm


def agree(comm: "Comm", error: str | None, what: str) -> None:
    """Every rank learns whether any rank failed `what` (`error`: this rank's cause, None when it
    succeeded); all raise CheckpointError together, each naming every failed rank and its cause."""
    raise_together(comm, error, what, CheckpointError)


_READ_ERRORS = (OSError, RuntimeError, KeyError, IndexError, TypeError, ValueError, AttributeError)
"""What a checkpoint read may raise besides CheckpointError: a missing or truncated file, a
pickle of the wrong shape. Named with the failing path; anything else is a bug and propagates."""

T = TypeVar("T")


_READS_IN_TURN: ContextVar[bool] = ContextVar("zeroshard_reads_in_turn", default=False)


@contextmanager
def reads_in_turn(on: bool) -> Iterator[None]:
    """Inside this block, the checkpoint reads of `read_agreed` run one local rank at a time
    (Note: [reads in turn]); `zero_optimization.pipeline_loading_checkpoint` turns it on
    around `load_checkpoint`."""
    token = _READS_IN_TURN.set(on)
    try:
        yield
    finally:
        _READS_IN_TURN.reset(token)


def read_agreed(comm: "Comm", what: str, where: str | os.PathLike[str], read: Callable[[], T]) -> T:
    """This rank's `read`, after every rank agreed that its own read succeeded (`agree`).

    A CheckpointError keeps its message; another read error is named with `where` ("<where>:
    <type>: <message>"). Collective: every rank calls it, and either all return or all raise.
    Inside `reads_in_turn(True)` the ranks of a node read one after another.
    """
    error, out = None, []

    def attempt() -> None:
        nonlocal error
        try:
            out.append(read())
        except CheckpointError as e:
            error = str(e)
        except _READ_ERRORS as e:
            error = f"{where}: {type(e).__name__}: {e}"

    if _READS_IN_TURN.get() and comm.world_size > 1:
        _in_turn(comm, attempt)
    else:
        attempt()
    agree(comm, error, what)
    if not out:
        raise AssertionError(f"expected {what} to have succeeded on every rank after they agreed")
    return out[0]


def _in_turn(comm: "Comm", attempt: Callable[[], None]) -> None:
    """Note: [reads in turn] A node whose ranks all read their part of a large checkpoint at
    once holds every rank's memory-mapped files and copies in host memory at the same time
    (DeepSpeed's `pipeline_loading_checkpoint` exists for this). Here local rank k reads in turn
    k, and every rank of `comm` passes a barrier after each turn, so at most one rank per node
    is reading at any moment. The number of turns is the largest local world size of the group
    (one all-reduce), so nodes of different sizes still take the same number of barriers. A
    rank whose read fails still takes every barrier; the `agree` after it reports the failure."""
    turns = torch.tensor([float(comm.groups.local_world_size)], device=comm.groups.device)
    comm.all_reduce(turns, "max")
    for turn in range(int(turns.item())):
        if turn == comm.groups.local_rank:
            attempt()
        comm.barrier()


def agree_found(comm: "Comm", found: bool, load_dir: str | os.PathLike[str]) -> None:
    """Refuse a load where some ranks see a `latest` file in `load_dir` and others do not."""
    flags = torch.tensor([0.0 if found else 1.0], device=comm.groups.device)
    comm.all_reduce(flags)
    if 0 < flags.item() < comm.world_size:
        raise CheckpointError(f"{load_dir}: some ranks see a `latest` file and others do not; "
                              "checkpoints must be on a file system every rank sees the same")
