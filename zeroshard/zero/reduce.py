"""The one gradient reducer every stage uses: staging pool, launch order, buckets in flight,
the reduction mode, the fold into a target, the drain.

Imports nothing of ours but `comm/codecs.py` (and `comm` for types). A compressed or quantised
reduction (qgZ, 1-bit) is one more `ReduceMode` handled in `GradReducer._issue`.

Note: [gradient bucket lifetime] A bucket's data is either a view of a buffer that lives for
the whole run (stage 0's flat gradient, stage 1's whole-gradient buffer: reducing in place
costs no memory) or a *staging* block taken from a pool of bucket-sized blocks (stages 2 and
3: gradients of one micro-batch, reduced and folded into the gradient shard). A staging block
goes back to the pool when its collective finished and its result was folded; at most
`max_staged_in_flight` staged buckets are outstanding before backward waits for the oldest,
which bounds the transient memory to that many blocks plus the ones still filling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from zeroshard.comm.codecs import DEFAULT_BLOCK_NUMEL, Quantized, dequantize, quantize_int4, quantize_int8

if TYPE_CHECKING:
    from zeroshard.comm import Comm, Handle

MAX_BUCKETS_IN_FLIGHT = 2
"""Staged buckets outstanding at once (with `overlap_comm`) before backward waits."""


class ReduceMode(Enum):
    """How one bucket of gradients is reduced over the data-parallel ranks."""

    ALL_REDUCE = "all_reduce"
    """In place; every rank keeps the whole sum (stage 0, stage 1 without offload)."""
    ALL_REDUCE_KEEP_CHUNK = "all_reduce_keep_chunk"
    """In place, then this rank's chunk is folded into the target (stage 1 with offload;
    stages 2/3 with `reduce_scatter: false`: on gloo, whose reduce-scatter is an all-reduce of a
    cloned input, this moves the same bytes without the clone)."""
    REDUCE_SCATTER = "reduce_scatter"
    """This rank's chunk of the sum arrives in a receive buffer, then is folded into the target."""
    QUANTIZED_REDUCE_SCATTER = "quantized_reduce_scatter"
    """qgZ, one level: each rank quantises the chunk meant for each rank (blockwise,
    `quant_bits`, comm/codecs.py), one all-to-all of codes and one of scales exchange them, and
    each rank dequantises the world_size contributions to its chunk and sums them in fp32.
    Per element the sum is off by at most the sum over source ranks of that rank's
    `amax_block / (2 * qmax)` (qmax 7 for int4, 127 for int8).

    Hierarchical, when the group spans several nodes of several ranks (GradReducer's
    `hierarchy`: the node group and the cross group, comm/groups.py): Note: [hierarchical
    qgZ]. One level on a single node (or one rank per node)."""


@dataclass(frozen=True, slots=True)
class ReduceOptions:
    mode: ReduceMode
    grad_dtype: torch.dtype
    """Where gradients accumulate and staging blocks live (fp32 by default)."""
    comm_dtype: torch.dtype | None = None
    """On the wire (`communication_data_type`); None: `grad_dtype`."""
    prescale_factor: float = 1.0
    """Divide each bucket by this before reducing (`gradient_predivide_factor`)."""
    overlap_comm: bool = True
    """False: wait for every collective as soon as it is issued."""
    quant_bits: int = 4
    """QUANTIZED_REDUCE_SCATTER: 4 (int4, two codes per byte) or 8."""
    quant_block_numel: int = DEFAULT_BLOCK_NUMEL
    """QUANTIZED_REDUCE_SCATTER: elements per scale."""


# Note: [hierarchical qgZ] W ranks, s per node, N = W / s nodes; rank r = n * s + l. A bucket is
# W chunks of k, chunk r for rank r; seen as [N][s][k], chunk (m, j) is rank m * s + j's.
#   1. within the node (node group, int8): rank l of each node gets the chunks of local rank l
#      on every node, [N][k], from its s node peers (an all-to-all of int8 codes + scales) and
#      sums them in fp32: the node's partial sums for those N chunks.
#   2. across nodes (cross group: local rank l of every node, int4): each sends partial sum m to
#      node m's rank l (an all-to-all of int4 codes + scales) and sums the N arrivals in fp32.
# Bytes per rank: step 1 moves P = W * k int8 codes (half of bf16) inside the node; step 2
# moves P / (2 s) bytes of int4 codes across nodes, against the one-level int4's P / 2 (of
# which (W - s) / W crosses): s times fewer inter-node bytes. Error per element of the result
# (A_j: the largest |g| of rank j's bucket, P_m: node m's partial sum after step 1):
#   |err| <= sum_j A_j / 254 + sum_m amax(P_m) / 14 <= sum_j A_j * (1/254 + (255/254) / 14),
# plus fp32 slack; int8 inside the node keeps step 1 nearly exact, and step 2 quantises one
# partial sum per node instead of one contribution per rank (the one-level bound is
# sum_j A_j / 14 over all W ranks).


class _Deferred:
    """Waits on the collectives of a composite reduction, then runs its local finish once."""

    __slots__ = ("_finish",)

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


@dataclass(slots=True)
class _InFlight:
    key: int
    handle: "Handle | _Deferred"
    result: Tensor | None  # 1D: what is folded into `target` (None: the sum stays in place)
    target: Tensor | None  # 1D: the rank's gradient-shard range for this bucket


class LaunchOrder:
    """Counts gradients arriving per bucket and says which buckets may launch now.

    `in_order=True` (stages 0-2): buckets launch strictly in index order on every rank, so the
    collectives pair up even when ranks finish their gradients in a different order.
    `in_order=False` (stage 3): a unit launches when its last gradient arrives; backward runs
    units in the same order on every rank.
    """

    def __init__(self, bucket_of: Sequence[int], counts: Sequence[int], *, in_order: bool) -> None:
        self._bucket_of = list(bucket_of)
        self._counts = list(counts)
        self._in_order = in_order
        self.reset()

    def reset(self) -> None:
        """A new micro-batch: no gradient seen, no bucket launched."""
        self._pending = list(self._counts)
        self._seen = [False] * len(self._bucket_of)
        self._launched = [False] * len(self._counts)
        self._next = 0

    def bucket_of(self, index: int) -> int:
        return self._bucket_of[index]

    def seen(self, index: int) -> bool:
        return self._seen[index]

    def arrive(self, index: int) -> list[int]:
        """Parameter `index`'s gradient arrived (first time this micro-batch): the buckets
        that may launch now."""
        if self._seen[index]:
            return []
        self._seen[index] = True
        bucket = self._bucket_of[index]
        self._pending[bucket] -= 1
        if not self._in_order:
            return [bucket] if self._pending[bucket] == 0 else []
        ready = []
        while self._next < len(self._counts) and self._pending[self._next] == 0:
            ready.append(self._next)
            self._next += 1
        return ready

    def mark_launched(self, bucket: int) -> None:
        self._launched[bucket] = True
        if self._in_order:
            self._next = max(self._next, bucket + 1)

    def remaining(self) -> list[int]:
        """Buckets not launched yet, in index order (at the end of backward)."""
        return [b for b in range(len(self._counts)) if not self._launched[b]]


class GradReducer:
    """Reduces buckets of gradients over the data-parallel group and folds the results.

    Args:
        comm: collectives over the data-parallel group.
        options: mode, dtypes, prescale, overlap.
        device: where staging blocks live (the model's device).
        block_numel: every staging block has this many elements (buckets of similar sizes, as
            stage 2 plans them, then share blocks); None: blocks are taken best-fit by size
            (stage 3, whose units differ: a large root unit never lends its block to a small one).
    """

    def __init__(self, comm: "Comm", options: ReduceOptions, *, device: torch.device,
                 block_numel: int | None = None, hierarchy: tuple["Comm", "Comm"] | None = None) -> None:
        self._comm, self._opt, self._device = comm, options, device
        self._hierarchy = hierarchy  # (node, cross) Comms: Note: [hierarchical qgZ]
        self._block_numel = block_numel
        self._rank, self._world = comm.rank, comm.world_size
        self._free: list[Tensor] = []             # the pool: free 1D grad_dtype blocks
        self._blocks: dict[int, Tensor] = {}      # key -> the block it holds this micro-batch
        self._staging: dict[int, Tensor] = {}     # key -> that block sliced to the bucket
        self._in_flight: list[_InFlight] = []
        self._folded: set[int] = set()            # keys whose target holds this step's data
        # Note: [folds into host memory]. With the gradient shard offloaded, a fold copies a GPU
        # result into pinned host memory asynchronously; nothing on the host may read the target
        # (or add into it) before that copy lands. Copies are issued at once and the adds of later
        # micro-batches deferred; `drain` waits for the copies (the event after the last one: they
        # are issued in order on one stream), then does the adds on the host.
        self._host_copied: torch.cuda.Event | None = None
        self._host_adds: list[tuple[Tensor, Tensor]] = []  # (host target, the copy to add into it)
        self._pool_bytes = 0

    @property
    def mode(self) -> ReduceMode:
        return self._opt.mode

    # -- staging ----------------------------------------------------------------------------

    def staging(self, key: int, numel: int) -> Tensor:
        """The zeroed staging block of bucket `key` (`numel` elements), taken from the pool on
        first use in a micro-batch. See Note: [gradient bucket lifetime]."""
        buf = self._staging.get(key)
        if buf is None:
            block = self._take(numel)
            self._staging[key] = buf = block[:numel].zero_()
            self._blocks[key] = block
        return buf

    def _take(self, numel: int) -> Tensor:
        size = self._block_numel or numel
        if size < numel:
            raise AssertionError(f"expected a bucket of at most {size} elements, got {numel}")
        # Best fit among free blocks no more than twice the need (uniform blocks: any).
        fits = [i for i, b in enumerate(self._free) if size <= b.numel() <= 2 * size]
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        self._pool_bytes += size * self._opt.grad_dtype.itemsize
        return torch.empty(size, dtype=self._opt.grad_dtype, device=self._device)

    def accumulate(self, key: int, numel: int, offset: int, grad: Tensor, first: bool) -> None:
        """Add (or, for the first gradient of the micro-batch, copy) `grad` at `offset`."""
        view = self.staging(key, numel)[offset : offset + grad.numel()]
        flat = grad.reshape(-1)
        view.copy_(flat) if first else view.add_(flat)

    def _give_back(self, key: int) -> None:
        self._staging.pop(key, None)
        block = self._blocks.pop(key, None)
        if block is not None:
            self._free.append(block)

    def pool_blocks(self) -> list[Tensor]:
        """The staging blocks the pool holds free (between steps: all of them)."""
        return list(self._free)

    def pool_bytes(self) -> int:
        """Bytes of every staging block allocated (kept for reuse across steps)."""
        return self._pool_bytes

    # -- launch, fold, drain ----------------------------------------------------------------

    def launch(self, key: int, data: Tensor, target: Tensor | None = None) -> None:
        """Start reducing bucket `key`'s `data` (1D: its staging block, or a view reduced in
        place); on completion fold this rank's chunk into `target` (copy on the first fold of
        the step, add after), unless the mode keeps the whole sum in place."""
        if self._opt.prescale_factor != 1.0:
            data.mul_(1.0 / self._opt.prescale_factor)
        handle, result = self._issue(data)
        if (target is None) != (result is None):
            raise AssertionError(f"expected a fold target exactly when mode {self.mode} yields a chunk")
        self._in_flight.append(_InFlight(key, handle, result, target))
        if not self._opt.overlap_comm:
            self.drain()
            return
        # Only staged buckets hold transient memory; in-place ones are bounded by backward itself.
        while sum(f.key in self._staging for f in self._in_flight) > MAX_BUCKETS_IN_FLIGHT:
            self._finish_oldest()

    def _issue(self, data: Tensor) -> tuple["Handle | _Deferred", Tensor | None]:
        mode, comm_dtype = self._opt.mode, self._opt.comm_dtype
        if mode is ReduceMode.QUANTIZED_REDUCE_SCATTER:
            if self._hierarchy is not None:
                return self._issue_hierarchical(data)
            return self._issue_quantized(data)
        if mode is ReduceMode.REDUCE_SCATTER:
            recv = torch.empty(data.numel() // self._world, dtype=data.dtype, device=data.device)
            return self._comm.reduce_scatter(recv, data, async_op=True, comm_dtype=comm_dtype), recv
        handle = self._comm.all_reduce(data, async_op=True, comm_dtype=comm_dtype)
        if mode is ReduceMode.ALL_REDUCE:
            return handle, None
        n = data.numel() // self._world
        return handle, data[self._rank * n : (self._rank + 1) * n]

    def _issue_quantized(self, data: Tensor) -> tuple[_Deferred, Tensor]:
        """See ReduceMode.QUANTIZED_REDUCE_SCATTER. Every chunk is quantised on its own, so a
        block never straddles two ranks' chunks and each rank's codes have the same length."""
        world = self._world
        k = data.numel() // world
        done = _start_exchange(self._comm, data.view(world, k), self._opt.quant_bits, self._opt.quant_block_numel)
        recv = torch.empty(k, dtype=data.dtype, device=data.device)
        return _Deferred(lambda: recv.copy_(done())), recv

    def _issue_hierarchical(self, data: Tensor) -> tuple[_Deferred, Tensor]:
        """Note: [hierarchical qgZ]. The second stage starts when the first is waited: the
        fold of the oldest bucket (or the drain) runs both, in order, on every rank."""
        node, cross = self._hierarchy  # type: ignore[misc]
        s, n, block = node.world_size, cross.world_size, self._opt.quant_block_numel
        k = data.numel() // (s * n)
        pieces = data.view(n, s, k).transpose(0, 1).reshape(s, n * k)  # piece j: for local rank j
        first = _start_exchange(node, pieces, 8, block)
        recv = torch.empty(k, dtype=data.dtype, device=data.device)

        def finish() -> None:
            partial = first()  # [N * k] fp32: this node's sums of the chunks of local rank l
            recv.copy_(_start_exchange(cross, partial.view(n, k), self._opt.quant_bits, block)())

        return _Deferred(finish), recv

    def _finish_oldest(self) -> None:
        f = self._in_flight.pop(0)
        f.handle.wait()
        if f.target is not None and f.result is not None:
            to_host = f.target.device.type == "cpu" and f.result.device.type == "cuda"
            if f.key in self._folded and to_host:  # Note: [folds into host memory]
                self._host_adds.append((f.target, f.result.to("cpu", non_blocking=True)))
            elif f.key in self._folded:
                f.target.add_(f.result.to(f.target.device))
            else:
                f.target.copy_(f.result, non_blocking=to_host)
                self._folded.add(f.key)
            if to_host:
                self._host_copied = torch.cuda.Event()
                self._host_copied.record(torch.cuda.current_stream(f.result.device))
        self._give_back(f.key)  # staging memory returns to the pool only after the fold

    def drain(self) -> None:
        """Wait for every bucket in flight and fold it; afterwards the targets hold the sums."""
        while self._in_flight:
            self._finish_oldest()
        if self._host_copied is not None:
            self._host_copied.synchronize()
            self._host_copied = None
        for target, host in self._host_adds:
            target.add_(host)
        self._host_adds.clear()

    def end_micro_batch(self) -> None:
        """Return blocks still held (buckets never launched this micro-batch) to the pool."""
        if self._in_flight:
            raise AssertionError(f"expected no bucket in flight, found {len(self._in_flight)}")
        for key in list(self._staging):
            self._give_back(key)

    def end_step(self, release_pool: bool = False) -> None:
        """The optimizer consumed the targets: the next fold of each bucket copies. `release_pool`:
        free the staging blocks too (Note: [gradient lifetime] in zero/grad_shard.py), so no
        gradient memory is held until the next backward takes blocks again."""
        self._folded.clear()
        if release_pool and not self._staging:
            self._free.clear()
            self._pool_bytes = 0


def _start_exchange(comm: "Comm", pieces: Tensor, bits: int, block: int) -> Callable[[], Tensor]:
    """Quantise row j of `pieces` ([group size, m]) for group rank j, start the all-to-alls of
    codes and scales; the returned function waits and gives the fp32 sum of the rows received."""
    quant = quantize_int4 if bits == 4 else quantize_int8
    world, m = pieces.shape
    parts = [quant(row, block) for row in pieces]
    codes = torch.cat([p.codes for p in parts])
    scales = torch.cat([p.scales for p in parts])
    codes_in, scales_in = torch.empty_like(codes), torch.empty_like(scales)
    waits = (comm.all_to_all(codes_in, codes, async_op=True), comm.all_to_all(scales_in, scales, async_op=True))

    def finish() -> Tensor:
        for h in waits:
            h.wait()
        total = torch.zeros(m, dtype=torch.float32, device=pieces.device)
        for src_codes, src_scales in zip(codes_in.chunk(world), scales_in.chunk(world)):
            total += dequantize(Quantized(codes=src_codes, scales=src_scales, numel=m, block_numel=block, bits=bits))
        return total

    return finish


class GradAccumulator:
    """A flat gradient buffer that lives across micro-batches (stage 0, stage 1).

    Each parameter's gradient is copied in on its first arrival of the step and added after;
    a parameter that received none by launch time is zeroed then.
    """

    def __init__(self, flat: Tensor, offsets: Sequence[int], shapes: Sequence[torch.Size]) -> None:
        self.flat = flat  # 1D grad_dtype
        self.views = [flat[off : off + s.numel()].view(s) for off, s in zip(offsets, shapes)]
        self._written = [False] * len(self.views)

    def add(self, index: int, grad: Tensor) -> None:
        view = self.views[index]
        view.add_(grad) if self._written[index] else view.copy_(grad)
        self._written[index] = True

    def fill_unwritten(self, first: int, last: int) -> None:
        for i in range(first, last):
            if not self._written[i]:  # unused in every micro-batch of the step
                self.views[i].zero_()
                self._written[i] = True

    def reset(self) -> None:
        self._written = [False] * len(self.views)
