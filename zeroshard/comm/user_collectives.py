"""The script's own collectives (torch.distributed, deepspeed.comm), sequenced and checked like zeroshard's.

Note: [script collectives]
A collective the script issues itself (``dist.all_reduce(t)`` between ``engine.step()`` calls, a
library's ``dist.barrier()``) on a group zeroshard tracks -- the default group, or one zeroshard
created -- shares that group's sequence with zeroshard's own collectives. Issued on one rank
only, it met the other ranks' next collective unannounced: a hang until the timeout, then gloo's
"Timed out waiting 30000ms for recv operation" on one rank (no rank, no call site) and a report
on the other that blamed the wrong collective. So while zeroshard's process group is up and
collectives are checked (``ZEROSHARD_COMM_VERIFY`` not "0", `verify_wanted`), ``install``
replaces torch.distributed's module-level collectives by wrappers that, on a tracked group,
record the call (sequence number and the script's file:line) and run the signature check
(Note: [collective signature check] in checked.py) before handing it to torch, as
deepspeed.comm's functions do (functional.py, through `checked_call`). An extra collective on
one rank is then reported by every rank at once, naming it.

The signature marks a collective the script issued (``CallRecord.checked_op``), so it never
agrees with one of zeroshard's, however alike: a rank-0-only ``dist.all_reduce`` of a gradient
bucket's size would otherwise agree with the other rank's next bucket all-reduce, and gloo would
pair them (wrong numbers, no error). A script collective never legitimately pairs with an
engine collective: every rank runs the engine's code alike.

Only the ``torch.distributed`` namespace is patched. torch's own functions call
``distributed_c10d``'s (``all_gather_object`` runs ``all_gather``), as functional.py does, so no
collective is counted twice; a reference taken before ``init_distributed`` (``from
torch.distributed import all_reduce``) stays torch's own and is not seen. Point-to-point calls
(send, recv, batch_isend_irecv) are left alone: there ranks differ by design. A CUDA tensor's
collective is counted but not checked (the check would synchronise the host, as for Comm).
``uninstall`` (``destroy_distributed``) puts torch's functions back.
Imports nothing of ours but ``comm.checked`` and ``comm.divergence``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from zeroshard.comm.checked import PendingIssue, checked_issue, verify_wanted, wait_checked
from zeroshard.comm.divergence import CollectiveTracker, tracker_of

_API = "torch.distributed"

Size = Literal["numel", "total", "op"]
"""How a collective's size is compared across ranks: the numel of one tensor argument, the total of
a list of tensors (every rank passes the same list sizes), or not at all ("op": split sizes, an
uneven gather or objects may differ per rank; the operation is still compared)."""

_COLLECTIVES: dict[str, tuple[str | None, Size]] = {
    "all_reduce": ("tensor", "numel"),
    "all_reduce_coalesced": ("tensors", "total"),
    "broadcast": ("tensor", "numel"),
    "reduce": ("tensor", "numel"),
    "all_gather": ("tensor_list", "total"),
    "all_gather_into_tensor": ("input_tensor", "numel"),
    "all_gather_coalesced": ("input_tensor_list", "op"),
    "reduce_scatter": ("input_list", "total"),
    "reduce_scatter_tensor": ("input", "numel"),
    "all_to_all": ("input_tensor_list", "op"),
    "all_to_all_single": ("input", "op"),
    "gather": ("tensor", "op"),
    "scatter": ("tensor", "op"),
    "barrier": (None, "op"),
    "monitored_barrier": (None, "op"),
    "all_gather_object": (None, "op"),
    "gather_object": (None, "op"),
    "broadcast_object_list": (None, "op"),
    "scatter_object_list": (None, "op"),
}
"""torch.distributed's collectives: the argument that gives the size (and device), and how."""


def checked_call(tracker: CollectiveTracker, call: Callable[[], Any], api: str, op: str, numel: int,
                 dtype: torch.dtype | None, timeout_s: float, *, check: bool) -> Any:
    """Run ``call`` (a collective the script issued through ``api`` on ``tracker``'s group) as
    collective number next of that group: recorded, then, with ``check``, signature-checked on
    every rank before it is issued here (Note: [script collectives]). Returns what ``call``
    returns; raises the divergence report as a CommError when the ranks' collectives differ, a
    peer never comes within ``timeout_s``, or ``call`` itself fails."""
    tracker.raise_if_mismatched(timeout_s)
    rec = tracker.issue(op, numel, dtype, api)
    tracker.begin_wait(rec)  # from here: the check waits for the peers in this thread, then the call
    if check:
        # Checked, then issued here: `call` may block (a synchronous op, an object collective),
        # which must not happen on the check's callback thread. Once the check has completed,
        # every earlier checked collective's data is issued (checks complete in order).
        pending = PendingIssue(rec, None)
        checked_issue(tracker, [pending], timedelta(seconds=timeout_s), wait_here=True)
        wait_checked(tracker, pending, timeout_s + 5.0, timeout_s)
    try:
        result = call()
    except Exception as e:
        raise tracker.fail(rec, e, timeout_s) from e
    # The caller waits an async work itself: counted as done once issued (the report then names
    # it as this rank's last collective, not as one in flight).
    tracker.end_wait(rec, done=True)
    return result


@dataclass(frozen=True, slots=True)
class _Arguments:
    """Where one collective's ``group`` and size argument sit in its positional arguments."""

    group_at: int
    data: str | None
    data_at: int
    size: Size


def _measure(data: Any, size: Size) -> tuple[int, torch.dtype | None, bool]:
    """(numel, dtype, on the CPU) of a collective's size argument (a tensor or a list of them)."""
    first = data[0] if isinstance(data, (list, tuple)) and data else data
    on_cpu = not isinstance(first, torch.Tensor) or first.device.type == "cpu"
    if size == "op" or not isinstance(first, torch.Tensor):
        return 0, None, on_cpu
    if size == "total":
        return sum(t.numel() for t in data), first.dtype, on_cpu
    return first.numel(), first.dtype, on_cpu


class _Installed:
    """What ``install`` replaced: name -> (torch's function, the wrapper), and the timeout."""

    originals: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}
    timeout_s: float = 1800.0
    generation: int = 0
    """Bumped by every install and uninstall: a wrapper left inside someone else's patch after
    ``uninstall`` passes calls straight through."""


def _wrap(name: str, original: Callable[..., Any], where: _Arguments) -> Callable[..., Any]:
    generation = _Installed.generation

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        # The hot path: a positional lookup and a dict lookup when the group is not tracked.
        if generation != _Installed.generation:
            return original(*args, **kwargs)
        group = args[where.group_at] if len(args) > where.group_at else kwargs.get("group")
        tracker = tracker_of(group if group is not None else dist.group.WORLD)
        if tracker is None:
            return original(*args, **kwargs)
        data = None
        if where.data is not None:
            data = args[where.data_at] if len(args) > where.data_at else kwargs.get(where.data)
        numel, dtype, on_cpu = _measure(data, where.size)
        return checked_call(tracker, lambda: original(*args, **kwargs), _API, name, numel, dtype,
                            _Installed.timeout_s, check=on_cpu)

    collective.__zeroshard_wraps__ = original  # type: ignore[attr-defined]
    return collective


def _arguments(original: Callable[..., Any], data: str | None, size: Size) -> _Arguments | None:
    """Positions of ``group`` and ``data`` in ``original``'s signature (None: no ``group``)."""
    names = list(inspect.signature(original).parameters)
    if "group" not in names:
        return None
    return _Arguments(names.index("group"), data, names.index(data) if data in names else len(names), size)


def install(timeout_s: float) -> None:
    """Wrap torch.distributed's collectives (Note: [script collectives]) with ``timeout_s`` for
    their checks; does nothing when checks are off or the wrappers are in place already."""
    _Installed.timeout_s = timeout_s
    if _Installed.originals or not verify_wanted():
        return
    _Installed.generation += 1
    for name, (data, size) in _COLLECTIVES.items():
        original = getattr(dist, name, None)
        if original is None:  # an older or newer torch without it
            continue
        original = getattr(original, "__zeroshard_wraps__", original)
        where = _arguments(original, data, size)
        if where is None:
            continue
        wrapper = _wrap(name, original, where)
        _Installed.originals[name] = (original, wrapper)
        setattr(dist, name, wrapper)


def uninstall() -> None:
    """Put torch.distributed's own collectives back (a wrapper someone else has since wrapped
    stays there, passing calls straight through)."""
    _Installed.generation += 1
    for name, (original, wrapper) in _Installed.originals.items():
        if getattr(dist, name, None) is wrapper:
            setattr(dist, name, original)
    _Installed.originals.clear()


def installed() -> bool:
    """Whether torch.distributed's collectives are wrapped now."""
    return bool(_Installed.originals)
