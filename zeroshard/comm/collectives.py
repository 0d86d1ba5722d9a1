"""Comm: collectives on flat tensors with timeouts, a communication dtype, async handles, a log.

Every collective is issued on the data-parallel process group's backend with a per-operation
timeout, and waited with that timeout (plus a grace), so a rank that diverges fails with a
``CommError`` naming every rank's last collective (Note: [divergence diagnostics] in
``divergence.py``) instead of hanging. Imports nothing of ours but ``comm``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from time import perf_counter
from typing import Literal

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from zeroshard.comm.call_record import CallRecord
from zeroshard.comm.checked import PendingIssue, checked_issue
from zeroshard.comm.divergence import CollectiveTracker, tracker_for
from zeroshard.comm.groups import ProcessGroups, group_store, node_rank_lists, subgroup
from zeroshard.comm.handle import Handle, WaitPolicy
from zeroshard.comm.log import CommLog
from zeroshard.comm.operands import check_flat, check_rank_list, comm_buffer, comm_copy, mixed_dtypes, nbytes
from zeroshard.comm.shm import Arena, DoneWork

ReduceOpName = Literal["sum", "avg", "max", "min"]
_RedOp = dist.ReduceOp
_REDUCE_OPS = {name: dist.ReduceOp(getattr(dist.ReduceOp, name.upper()))
               for name in ("sum", "avg", "max", "min")}
_WAIT_GRACE_S = 5.0
"""Work.wait's timeout exceeds the per-op timeout by this much. The per-op timeout goes to the
backend with each operation, so gloo's own timeout fires first and frees its worker thread:
a gloo op abandoned by a Work.wait timeout alone would keep the interpreter from exiting
until the op ends (up to the process group's timeout)."""
_UNSUPPORTED = ("not supported", "unsupported", "not implemented", "does not support",
                "cannot use")


def _is_unsupported(error: BaseException) -> bool:
    text = str(error).lower()
    return any(marker in text for marker in _UNSUPPORTED)


class Comm:
    """Collectives on the data-parallel group of ``groups``, on flat (contiguous) tensors.

    Every method takes ``async_op`` (return before completion; call ``Handle.wait()``) and,
    where data moves, ``comm_dtype``: the data travels (and is reduced) in that dtype, in a
    cast copy that is written back into the caller's tensor on ``wait()`` (so input and output
    may then differ in dtype: bf16 gradients reduced into an fp32 shard). Reduction ops are
    "sum", "avg", "max", "min". ``src``/``dst`` are ranks in the group. With world size 1 every
    collective is a local no-op or copy with the same semantics (the average of one is itself).

    Args:
        groups: from :func:`init_distributed`.
        timeout_s: per-collective timeout in seconds; default ``groups.timeout_s``.
        log: a :class:`CommLog` that records every call, or None.
        label: how the log names this Comm's group ("world"; "node" / "cross" for the groups
            :meth:`split` builds).

    Example::

        comm = Comm(init_distributed())
        h = comm.all_reduce(grads, "avg", async_op=True, comm_dtype=torch.float32)
        ...  # overlap other work
        h.wait()
    """

    def __init__(self, groups: ProcessGroups, *, timeout_s: float | None = None,
                 log: CommLog | None = None, label: str = "world") -> None:
        self.groups = groups
        self.label = label
        self.rank = groups.rank
        self.world_size = groups.world_size
        self.timeout_s = groups.timeout_s if timeout_s is None else float(timeout_s)
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}.")
        self._timeout = timedelta(seconds=self.timeout_s)
        if groups.world_size > 1 and groups.dp_group is None:
            raise ValueError(f"ProcessGroups has world_size {groups.world_size} but no dp_group; "
                             "build it with init_distributed().")
        pg = groups.dp_group if groups.world_size > 1 else None
        self._pg = pg
        self._tracker: CollectiveTracker | None = None
        if pg is not None:
            self._tracker = tracker_for(pg, groups.rank, groups.world_size, group_store)
        on_cpu = groups.device.type == "cpu"
        self._policy = WaitPolicy(
            tracker=self._tracker, timeout_s=self.timeout_s,
            wait_timeout=timedelta(seconds=self.timeout_s + _WAIT_GRACE_S) if on_cpu else None,
            log=log, sync_device=None if on_cpu else groups.device, group=label)
        # Note: [collective signature check] in checked.py. ZEROSHARD_COMM_VERIFY=0 turns it off.
        self._verify = (pg is not None and on_cpu
                        and os.environ.get("ZEROSHARD_COMM_VERIFY", "1") != "0")
        self._shared = pg is not None and on_cpu and self._tracker is not None
        """Whether data may go through the group's shared-memory arena (Note: [shared-memory
        collectives] in shm.py), decided per call by ``_arena``."""
        self._together: list[PendingIssue] | None = None
        """Collectives of the open ``issued_together()`` block, checked together when it ends."""
        self._caps: dict[str, bool] = {}
        """Capabilities found missing at first use: "avg", "all_gather_single",
        "reduce_scatter_single", "all_to_all_single" -> False selects the fallback."""

    def split(self, rank_lists: Sequence[Sequence[int]], label: str) -> Comm:
        """A Comm over the one list of ``rank_lists`` that holds this rank (ranks of this
        group), sharing this Comm's timeout and log; the log names its calls ``label``.

        Collective: every rank calls it with the same lists, which partition the group. The
        sub-groups are created once per partition and reused (``comm/groups.py``).
        """
        return Comm(subgroup(self.groups, rank_lists), timeout_s=self.timeout_s, log=self.log,
                    label=label)

    def node_split(self, size: int) -> tuple[Comm, Comm]:
        """ZeRO++'s (node, cross) Comms for `size` ranks of this group per node: node n holds
        positions [n * size, (n + 1) * size), a cross group one position per node (hpZ,
        hierarchical qgZ). On a mesh axis (comm/topology.py) these are the groups of
        ``MeshGroups.node_split(size)``.
        """
        nodes, cross = node_rank_lists(self.world_size, size)
        return self.split(nodes, "node"), self.split(cross, "cross")

    @contextmanager
    def issued_together(self, *, waited_next: bool = False) -> Iterator[None]:
        """Asynchronous collectives issued inside share one signature check, started when the
        block ends; their data moves after it (Note: [collective signature check] in checked.py).

        For a burst issued back to back and waited after, such as the parameter all-gather after
        a ZeRO-1/2 step: one check instead of one per collective. Every rank must issue the same
        collectives in the block (a rank that differs is reported, as for single collectives).
        Without the check (NCCL, ``ZEROSHARD_COMM_VERIFY=0``) it changes nothing.

        ``waited_next``: the caller waits for the burst right after the block, so the check may be
        decided in its thread (Note: [signature board]: no hand-over to the board's poller).
        """
        if self._together is not None or not self._verify or self._tracker is None:
            yield
            return
        self._together = []
        try:
            yield
        finally:
            items, self._together = self._together, None
            if items:
                checked_issue(self._tracker, items, self._timeout, wait_here=waited_next)

    @property
    def log(self) -> CommLog | None:
        """The comm log given at construction, or None."""
        return self._policy.log

    # ---- plumbing -------------------------------------------------------------------------
    def _start(self, op: str, numel: int, dtype: torch.dtype | None, nbytes: int,
               issue: Callable[[], dist.Work] | None, finish: Callable[[], None] | None,
               async_op: bool, *, in_caller: bool = False) -> Handle:
        """Issue on the group (``issue``) or locally (``issue`` None), then wait unless async.

        ``in_caller``: the data moves in this thread even when ``async_op`` (a shared-memory
        collective, Note: [shared-memory collectives] in shm.py), so its check is decided here too
        rather than by the board's poller thread: a copy and a spin in a second thread of each
        rank cost 7-8% of a training step on the 2-core test machine (bench/results.md)."""
        t0 = perf_counter() if self.log is not None else 0.0
        work: dist.Work | None = None
        rec: CallRecord | None = None
        pending: PendingIssue | None = None
        if issue is not None:
            tracker = self._tracker
            if tracker is None:
                raise AssertionError("expected a tracker for a collective with a process group")
            tracker.raise_if_mismatched(self.timeout_s)
            rec = tracker.issue(op, numel, dtype)
            if self._verify:
                # Note: [collective signature check] in checked.py: the data is issued by the
                # check's completion, off this thread; wait() meets it there.
                pending = PendingIssue(rec, issue)
                if self._together is None:
                    checked_issue(tracker, [pending], self._timeout, wait_here=not async_op or in_caller)
                elif async_op:
                    self._together.append(pending)
                else:
                    raise ValueError(f"{op}: inside issued_together() collectives must be asynchronous "
                                     "(async_op=True): their data moves when the block ends.")
            else:
                try:
                    work = issue()
                except Exception as e:
                    raise tracker.fail(rec, e, self.timeout_s) from e
                if self._policy.wait_timeout is None:
                    tracker.watch_stream_work(rec, work, self.timeout_s)
        handle = Handle(self._policy, work, rec, finish, op, nbytes, t0, async_op, pending)
        if not async_op:
            handle.wait()
        return handle

    def shares_memory(self) -> bool:
        """Whether this group's CPU collectives go through the shared-memory arena (Note:
        [shared-memory collectives] in shm.py). Collective the first time on a group (it builds
        the group's board): every rank must call it at the same point."""
        return self._arena(torch.empty(0)) is not None

    def _arena(self, t: torch.Tensor, op: str | None = None) -> Arena | None:
        """The shared-memory arena for a collective on ``t`` (with reduction ``op``), or None:
        gloo carries it. Every rank decides alike: from the group's agreed board and the
        collective's dtype and op, which the signature check compares before any data moves."""
        if not self._shared or t.device.type != "cpu" or not Arena.supports(t.dtype, op):
            return None
        tracker = self._tracker
        board = tracker.shared_board(self._timeout) if tracker is not None else None
        return None if board is None else board.arena

    def _native(self, cap: str, native: Callable[[], dist.Work],
                fallback: Callable[[], dist.Work]) -> dist.Work:
        """Try the backend's op once; if it is unsupported, use the fallback from then on.

        An unsupported op fails when issued, identically on every rank, before any data
        moves, so switching to the fallback keeps the ranks in step.
        """
        if self._caps.get(cap, True):
            try:
                return native()
            except (RuntimeError, NotImplementedError, ValueError) as e:
                if not _is_unsupported(e):
                    raise
                self._caps[cap] = False
        return fallback()

    def _root(self, root: int, name: str) -> None:
        if not 0 <= root < self.world_size:
            raise ValueError(f"{name}={root} is not a rank of the group (size {self.world_size}).")

    def _reduce_op(self, op: str, dtype: torch.dtype) -> _RedOp:
        red = _REDUCE_OPS.get(op)
        if red is None:
            raise ValueError(f"op={op!r}: expected one of {sorted(_REDUCE_OPS)}.")
        if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
            raise ValueError(f"op='avg' needs a floating dtype, got {dtype}; use 'sum'.")
        return red

    def _reducing(self, op: str, make: Callable[[_RedOp], dist.Work],
                  divide: list[bool]) -> dist.Work:
        """Issue a reduction; "avg" falls back to SUM (and ``divide[0] = True``) if needed."""
        red = _REDUCE_OPS[op]
        if op != "avg":
            return make(red)

        def fallback() -> dist.Work:
            divide[0] = True
            return make(_REDUCE_OPS["sum"])

        return self._native("avg", lambda: make(red), fallback)

    # ---- collectives ----------------------------------------------------------------------
    def broadcast(self, t: torch.Tensor, src: int, *, async_op: bool = False,
                  comm_dtype: torch.dtype | None = None) -> Handle:
        """Copy ``t`` of rank ``src`` into ``t`` on every rank."""
        check_flat(t, "t")
        self._root(src, "src")
        buf = comm_copy(t, comm_dtype)

        def finish() -> None:
            if buf is not t and self.rank != src:
                t.copy_(buf)

        issue, arena = None, None
        if self._pg is not None:
            pg = self._pg
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor, opts.timeout = src, 0, self._timeout
            arena = self._arena(buf)

            def issue() -> dist.Work:
                if arena is None:
                    return pg.broadcast([buf], opts)
                arena.broadcast(buf.view(-1), src, self.timeout_s)
                return DoneWork()

        return self._start("broadcast", buf.numel(), buf.dtype, nbytes(buf), issue, finish,
                           async_op, in_caller=arena is not None)

    @torch.no_grad()
    def broadcast_values(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Give every tensor of ``tensors`` (any shapes, views included) rank ``src``'s values: one
        collective per dtype over their concatenation, so nothing is converted (lossless); a tensor
        named twice (tied weights) is sent once. Every rank must pass the same list."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in {id(t): t for t in tensors if t.numel() > 0}.values():
            by_dtype.setdefault(t.dtype, []).append(t)
        if self.world_size == 1:
            return
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            self.broadcast(flat, src=src)
            offset = 0
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def scatter(self, out: torch.Tensor, in_list: Sequence[torch.Tensor] | None, src: int, *,
                async_op: bool = False, comm_dtype: torch.dtype | None = None) -> Handle:
        """Rank ``src`` sends ``in_list[r]`` to rank r's ``out`` (``in_list`` only on src)."""
        check_flat(out, "out")
        self._root(src, "src")
        in_bufs: list[torch.Tensor] = []
        if self.rank == src:
            in_list = check_rank_list("scatter", "in_list", in_list, f"src rank {src}", self.world_size,
                                       out.numel(), "out")
            in_bufs = [comm_copy(x, comm_dtype) for x in in_list]
        out_buf = comm_buffer(out, comm_dtype)

        def finish() -> None:
            if self._pg is None:
                out_buf.copy_(in_bufs[0].view_as(out_buf))
            if out_buf is not out:
                out.copy_(out_buf)

        issue = None
        if self._pg is not None:
            pg = self._pg
            opts = dist.ScatterOptions()
            opts.rootRank, opts.timeout = src, self._timeout
            inputs = [in_bufs] if self.rank == src else []
            issue = lambda: pg.scatter([out_buf], inputs, opts)
        return self._start("scatter", out_buf.numel(), out_buf.dtype,
                           nbytes(out_buf) * self.world_size, issue, finish, async_op)

    def gather(self, t: torch.Tensor, out_list: Sequence[torch.Tensor] | None, dst: int, *,
               async_op: bool = False, comm_dtype: torch.dtype | None = None) -> Handle:
        """Rank ``dst`` receives every rank's ``t`` into ``out_list[r]`` (only on dst)."""
        check_flat(t, "t")
        self._root(dst, "dst")
        buf = comm_copy(t, comm_dtype)
        out_bufs: list[torch.Tensor] = []
        if self.rank == dst:
            out_list = check_rank_list("gather", "out_list", out_list, f"dst rank {dst}", self.world_size,
                                        t.numel(), "t")
            out_bufs = [comm_buffer(x, comm_dtype) for x in out_list]

        def finish() -> None:
            if self._pg is None:
                out_bufs[0].copy_(buf.view_as(out_bufs[0]))
            if out_list is not None and self.rank == dst:
                for x, b in zip(out_list, out_bufs):
                    if b is not x:
                        x.copy_(b)

        issue = None
        if self._pg is not None:
            pg = self._pg
            opts = dist.GatherOptions()
            opts.rootRank, opts.timeout = dst, self._timeout
            outputs = [out_bufs] if self.rank == dst else []
            issue = lambda: pg.gather(outputs, [buf], opts)
        return self._start("gather", buf.numel(), buf.dtype, nbytes(buf) * self.world_size,
                           issue, finish, async_op)

    def all_gather(self, out: torch.Tensor, in_: torch.Tensor, *, async_op: bool = False,
                   comm_dtype: torch.dtype | None = None) -> Handle:
        """``out[r * n:(r + 1) * n] = in_`` of rank r, on every rank (``n = in_.numel()``).

        Uses the backend's single-tensor all-gather; falls back to ``allgather`` into views
        of ``out`` where the backend lacks it (same bytes moved).
        """
        check_flat(out, "out")
        check_flat(in_, "in_")
        n = in_.numel()
        if out.numel() != n * self.world_size or mixed_dtypes(out, in_, comm_dtype):
            raise ValueError(f"all_gather: out must have world_size * in_.numel() = "
                             f"{self.world_size} * {n} elements of {in_.dtype} (another dtype "
                             f"only with comm_dtype); got {out.numel()} of {out.dtype}.")
        in_buf = comm_copy(in_, comm_dtype).view(-1)
        out_buf = comm_buffer(out, comm_dtype)

        def finish() -> None:
            if self._pg is None:
                out_buf.view(-1).copy_(in_buf)
            if out_buf is not out:
                out.view(-1).copy_(out_buf.view(-1))

        issue, arena = None, None
        if self._pg is not None:
            pg = self._pg
            opts = AllgatherOptions()
            opts.timeout = self._timeout
            single = getattr(pg, "all_gather_single", None) or pg._allgather_base
            chunks = list(out_buf.view(-1).split(n))
            arena = self._arena(in_buf)

            def issue() -> dist.Work:
                if arena is None:
                    return self._native("all_gather_single", lambda: single(out_buf.view(-1), in_buf, opts),
                                        lambda: pg.allgather([chunks], [in_buf], opts))
                arena.all_gather(out_buf.view(-1), in_buf, self.timeout_s)
                return DoneWork()

        return self._start("all_gather", n, in_buf.dtype, nbytes(in_buf) * self.world_size,
                           issue, finish, async_op, in_caller=arena is not None)

    def reduce(self, t: torch.Tensor, dst: int, op: ReduceOpName = "sum", *,
               async_op: bool = False, comm_dtype: torch.dtype | None = None) -> Handle:
        """Reduce ``t`` of every rank into ``t`` on rank ``dst``; other ranks' ``t`` is
        unspecified afterwards (unchanged when ``comm_dtype`` casts a copy)."""
        check_flat(t, "t")
        self._root(dst, "dst")
        buf = comm_copy(t, comm_dtype)
        self._reduce_op(op, buf.dtype)
        divide = [False]

        def finish() -> None:
            if self.rank == dst:
                if divide[0]:
                    buf.div_(self.world_size)
                if buf is not t:
                    t.copy_(buf)

        issue = None
        if self._pg is not None:
            pg = self._pg

            def make(red: _RedOp) -> dist.Work:
                opts = dist.ReduceOptions()
                opts.reduceOp, opts.rootRank, opts.rootTensor = red, dst, 0
                opts.timeout = self._timeout
                return pg.reduce([buf], opts)

            issue = lambda: self._reducing(op, make, divide)
        return self._start("reduce", buf.numel(), buf.dtype, nbytes(buf), issue, finish,
                           async_op)

    def reduce_scatter(self, out: torch.Tensor, in_: torch.Tensor, op: ReduceOpName = "sum", *,
                       async_op: bool = False, comm_dtype: torch.dtype | None = None) -> Handle:
        """``out`` = reduction over ranks of ``in_[rank * n:(rank + 1) * n]`` (``n = out.numel()``).

        ``in_`` is left unchanged. Where the backend lacks a single-tensor reduce-scatter,
        falls back to an all-reduce of a copy of ``in_`` and keeps this rank's slice: correct,
        but about twice the bytes and world_size times the reduction work.
        """
        check_flat(out, "out")
        check_flat(in_, "in_")
        n = out.numel()
        if in_.numel() != n * self.world_size or mixed_dtypes(out, in_, comm_dtype):
            raise ValueError(f"reduce_scatter: in_ must have world_size * out.numel() = "
                             f"{self.world_size} * {n} elements of {out.dtype} (another dtype "
                             f"only with comm_dtype); got {in_.numel()} of {in_.dtype}.")
        in_buf = comm_copy(in_, comm_dtype).view(-1)
        self._reduce_op(op, in_buf.dtype)
        out_buf = comm_buffer(out, comm_dtype)
        divide = [False]
        scratch: list[torch.Tensor] = []  # the all-reduced copy, when the fallback ran

        def finish() -> None:
            if self._pg is None:
                out_buf.view(-1).copy_(in_buf)
            elif scratch:
                out_buf.view(-1).copy_(scratch[0][self.rank * n:(self.rank + 1) * n])
            if divide[0]:
                out_buf.div_(self.world_size)
            if out_buf is not out:
                out.copy_(out_buf)

        issue, arena = None, None
        if self._pg is not None:
            pg = self._pg
            single = getattr(pg, "reduce_scatter_single", None) or pg._reduce_scatter_base

            def make(red: _RedOp) -> dist.Work:
                opts = dist.ReduceScatterOptions()
                opts.reduceOp, opts.timeout = red, self._timeout

                def fallback() -> dist.Work:
                    scratch.append(in_buf.clone())
                    ar = dist.AllreduceOptions()
                    ar.reduceOp, ar.timeout = red, self._timeout
                    return pg.allreduce([scratch[0]], ar)

                return self._native("reduce_scatter_single",
                                    lambda: single(out_buf.view(-1), in_buf, opts), fallback)

            red = "sum" if op == "avg" else op  # the arena sums; "avg" divides in finish()
            arena = self._arena(in_buf, red)

            def issue() -> dist.Work:
                if arena is None:
                    return self._reducing(op, make, divide)
                arena.reduce_scatter(out_buf.view(-1), in_buf, red, self.timeout_s)
                divide[0] = op == "avg"
                return DoneWork()

        return self._start("reduce_scatter", in_buf.numel(), in_buf.dtype, nbytes(in_buf),
                           issue, finish, async_op, in_caller=arena is not None)

    def all_reduce(self, t: torch.Tensor, op: ReduceOpName = "sum", *, async_op: bool = False,
                   comm_dtype: torch.dtype | None = None) -> Handle:
        """Replace ``t`` on every rank by the reduction of all ranks' ``t``."""
        check_flat(t, "t")
        buf = comm_copy(t, comm_dtype)
        self._reduce_op(op, buf.dtype)
        divide = [False]

        def finish() -> None:
            if divide[0]:
                buf.div_(self.world_size)
            if buf is not t:
                t.copy_(buf)

        issue, arena = None, None
        if self._pg is not None:
            pg = self._pg

            def make(red: _RedOp) -> dist.Work:
                opts = dist.AllreduceOptions()
                opts.reduceOp, opts.timeout = red, self._timeout
                return pg.allreduce([buf], opts)

            red = "sum" if op == "avg" else op  # the arena sums; "avg" divides in finish()
            arena = self._arena(buf, red)

            def issue() -> dist.Work:
                if arena is None:
                    return self._reducing(op, make, divide)
                arena.all_reduce(buf.view(-1), red, self.timeout_s)
                divide[0] = op == "avg"
                return DoneWork()

        return self._start("all_reduce", buf.numel(), buf.dtype, nbytes(buf), issue, finish,
                           async_op, in_caller=arena is not None)

    def all_to_all(self, out: torch.Tensor, in_: torch.Tensor, *, async_op: bool = False,
                   comm_dtype: torch.dtype | None = None) -> Handle:
        """Equal splits: chunk s of ``out`` on rank r = chunk r of ``in_`` on rank s.

        Where the backend lacks ``all_to_all_single``, falls back to an all-gather of every
        rank's whole ``in_`` and keeps this rank's chunks (world_size times the bytes).
        """
        check_flat(out, "out")
        check_flat(in_, "in_")
        numel = in_.numel()
        if out.numel() != numel or mixed_dtypes(out, in_, comm_dtype) or numel % self.world_size:
            raise ValueError(f"all_to_all: out and in_ must have the same dtype and numel, "
                             f"divisible by {self.world_size}; got out {out.numel()} "
                             f"{out.dtype}, in_ {numel} {in_.dtype}.")
        k = numel // self.world_size
        in_buf = comm_copy(in_, comm_dtype).view(-1)
        out_buf = comm_buffer(out, comm_dtype)
        gathered: list[torch.Tensor] = []

        def finish() -> None:
            if self._pg is None:
                out_buf.view(-1).copy_(in_buf)
            elif gathered:  # [source rank, destination rank, k]
                table = gathered[0].view(self.world_size, self.world_size, k)
                out_buf.view(self.world_size, k).copy_(table[:, self.rank, :])
            if out_buf is not out:
                out.copy_(out_buf)

        issue = None
        if self._pg is not None:
            pg = self._pg
            opts = dist.AllToAllOptions()
            opts.timeout = self._timeout

            def fallback() -> dist.Work:
                gathered.append(torch.empty(numel * self.world_size, dtype=in_buf.dtype,
                                            device=in_buf.device))
                ag = AllgatherOptions()
                ag.timeout = self._timeout
                return pg.allgather([list(gathered[0].split(numel))], [in_buf], ag)

            issue = lambda: self._native(
                "all_to_all_single",
                lambda: pg.alltoall_base(out_buf.view(-1), in_buf, [], [], opts), fallback)
        return self._start("all_to_all", numel, in_buf.dtype, nbytes(in_buf), issue, finish,
                           async_op)

    def barrier(self, *, async_op: bool = False) -> Handle:
        """Wait until every rank of the group has reached this barrier."""
        issue = None
        if self._pg is not None:
            pg = self._pg
            opts = dist.BarrierOptions()
            opts.timeout, opts.device = self._timeout, self.groups.device
            issue = lambda: pg.barrier(opts)
        return self._start("barrier", 0, None, 0, issue, None, async_op)


__all__ = ["Comm", "Handle", "ReduceOpName"]
