"""The wrappers of torch.distributed's collectives (Note: [script collectives] in
comm/user_collectives.py) without a process group: what they hand to the check, what they leave
alone, and that uninstall puts torch's functions back. The 2-rank behaviour is
tests/launch/test_user_collectives.py's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from zeroshard.comm import user_collectives
from zeroshard.comm.call_record import CallRecord, signature
from zeroshard.comm.divergence_report import disagreement

TRACKED = object()
"""A group the fake tracker lookup knows."""


class Calls:
    def __init__(self) -> None:
        self.checked: list[tuple[str, str, int, torch.dtype | None, bool]] = []
        self.torch: list[tuple[Any, ...]] = []


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    """torch's all_reduce and barrier replaced by recorders, the tracker lookup and the check by
    fakes; the wrappers installed for the test and removed after it."""
    seen = Calls()

    def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> str:
        seen.torch.append(("all_reduce", tensor.numel(), group))
        return "work"

    def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> None:
        seen.torch.append(("barrier", group))

    def checked_call(tracker: Any, call: Any, api: str, op: str, numel: int, dtype: torch.dtype | None,
                     timeout_s: float, *, check: bool) -> Any:
        seen.checked.append((api, op, numel, dtype, check))
        return call()

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "barrier", barrier)
    monkeypatch.setattr(user_collectives, "tracker_of", lambda g: "tracker" if g is TRACKED else None)
    monkeypatch.setattr(user_collectives, "checked_call", checked_call)
    monkeypatch.delenv("ZEROSHARD_COMM_VERIFY", raising=False)
    assert not user_collectives.installed()
    user_collectives.install(12.0)
    try:
        yield seen
    finally:
        user_collectives.uninstall()


def test_a_tracked_groups_collectives_are_checked_with_their_size(calls: Calls) -> None:
    assert dist.all_reduce.__name__ == "all_reduce"  # functools.wraps: help() and logs unchanged
    assert dist.all_reduce(torch.ones(3), None, TRACKED) == "work"  # group given by position
    dist.all_reduce(torch.ones(5, dtype=torch.float64), group=TRACKED, async_op=True)
    dist.barrier(TRACKED)
    assert calls.checked == [("torch.distributed", "all_reduce", 3, torch.float32, True),
                             ("torch.distributed", "all_reduce", 5, torch.float64, True),
                             ("torch.distributed", "barrier", 0, None, True)]
    assert [c[0] for c in calls.torch] == ["all_reduce", "all_reduce", "barrier"]  # each issued once


def test_an_untracked_group_goes_straight_to_torch(calls: Calls) -> None:
    other = object()
    dist.all_reduce(torch.ones(2), group=other)
    dist.barrier(group=other)
    assert calls.checked == [] and calls.torch == [("all_reduce", 2, other), ("barrier", other)]


def test_uninstall_puts_torchs_functions_back(calls: Calls, monkeypatch: pytest.MonkeyPatch) -> None:
    wrapper = dist.all_reduce
    user_collectives.uninstall()
    assert not user_collectives.installed()
    assert dist.all_reduce is wrapper.__zeroshard_wraps__  # type: ignore[attr-defined]
    # A wrapper someone else kept (a later patch over ours) no longer counts anything.
    wrapper(torch.ones(1), group=TRACKED)
    assert calls.checked == [] and calls.torch == [("all_reduce", 1, TRACKED)]
    # Installed again over a kept wrapper: torch's function is wrapped once, not twice.
    monkeypatch.setattr(dist, "all_reduce", wrapper)
    user_collectives.install(12.0)
    dist.all_reduce(torch.ones(1), group=TRACKED)
    assert len(calls.checked) == 1 and len(calls.torch) == 2


def test_nothing_is_wrapped_with_the_checks_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEROSHARD_COMM_VERIFY", "0")
    before = dist.all_reduce
    user_collectives.install(12.0)
    assert dist.all_reduce is before and not user_collectives.installed()


def _record(api: str) -> CallRecord:
    return CallRecord(7, "all_reduce", 161, torch.float32, ("train.py", 40, None, 0), 0.0, api)


def test_the_scripts_collective_never_agrees_with_zeroshards() -> None:
    # Note: [script collectives]: alike in operation, size and dtype, still a different signature.
    script, ours = _record("torch.distributed"), _record("")
    assert signature(script.checked_op, 161, torch.float32) != signature(ours.checked_op, 161, torch.float32)
    # Both of the script's APIs sign alike: a deepspeed.comm call may pair with a torch.distributed one.
    assert _record("deepspeed.comm").checked_op == script.checked_op


def test_disagreement_names_the_scripts_collective_first() -> None:
    def state(rank: int, call: dict[str, Any]) -> dict[str, Any]:
        return {"rank": rank, "seq": 7, "mismatch": call, "waiting": None, "last": call, "pending": []}

    script = {"seq": 7, "op": "torch.distributed.all_reduce", "numel": 1, "dtype": "float32",
              "where": "train.py:20", "api": "torch.distributed"}
    ours = {"seq": 7, "op": "reduce_scatter", "numel": 192, "dtype": "float32",
            "where": "reduce.py:274 via train.py:16"}
    states = {0: state(0, script), 1: state(1, ours), 2: state(2, ours)}
    assert disagreement(states, 7) == ("rank 0 issued torch.distributed.all_reduce(numel=1, float32) at train.py:20; "
                                       "ranks 1, 2 issued zeroshard's reduce_scatter(numel=192, float32) at "
                                       "reduce.py:274 via train.py:16")
    assert disagreement({0: state(0, ours), 1: state(1, ours)}, 7) is None
