"""comm/agreement.py: the one "every rank raises together" primitive, at every world size the
suite runs (1, 2, 3): every rank gets every rank's outcome and key, and a failure on some ranks
raises on all of them with every cause named; the checkpoint writer's `agree` and the pipeline's
failure vote are built on it."""

from __future__ import annotations

import pytest

from zeroshard.checkpoint.agreed import agree
from zeroshard.comm import Comm, ProcessGroups
from zeroshard.comm.agreement import MESSAGE_BYTES, RankOutcome, exchange_outcomes, failures, raise_together
from zeroshard.errors import CheckpointError


def test_every_rank_sees_every_outcome_and_key(comm: Comm) -> None:
    error = f"no space on rank {comm.rank}" if comm.rank % 2 else None
    got = exchange_outcomes(comm, error, key=100 + comm.rank)
    want = [RankOutcome(f"no space on rank {r}" if r % 2 else None, 100 + r) for r in range(comm.world_size)]
    assert got == want
    assert failures(got) == [(r, f"no space on rank {r}") for r in range(1, comm.world_size, 2)]


def test_success_returns_on_every_rank(comm: Comm) -> None:
    raise_together(comm, None, "writing", CheckpointError)
    agree(comm, None, "writing")


def test_a_failure_on_the_last_rank_raises_everywhere_with_its_cause(comm: Comm) -> None:
    last = comm.world_size - 1
    error = "disk full at /ckpt/rank.pt" if comm.rank == last else None
    with pytest.raises(CheckpointError) as info:
        agree(comm, error, "writing checkpoint files")
    text = str(info.value)
    assert text.startswith(f"rank {comm.rank}: writing checkpoint files failed")
    assert "disk full at /ckpt/rank.pt" in text
    if comm.rank != last:
        assert f"on rank(s) [{last}]" in text


def test_several_causes_are_all_named(comm: Comm, groups: ProcessGroups) -> None:
    if groups.world_size < 2:
        pytest.skip("several failing ranks need a world of at least 2 ranks")
    error = f"cause {comm.rank}"
    with pytest.raises(ValueError, match=r"failed on rank\(s\) \[0, 1") as info:
        raise_together(comm, error, "publishing", ValueError)
    assert all(f"rank {r}: cause {r}" in str(info.value) for r in range(comm.world_size))


def test_long_messages_are_cut_not_lost(comm: Comm) -> None:
    long = "x" * (3 * MESSAGE_BYTES) + "é"
    got = exchange_outcomes(comm, long)
    assert all(o.error == "x" * MESSAGE_BYTES for o in got)
    with pytest.raises(ValueError, match="does not fit in 7 bytes"):
        exchange_outcomes(comm, None, key=1 << 56)
