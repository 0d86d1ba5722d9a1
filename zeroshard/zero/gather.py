"""How a stage-3 unit becomes full: one `UnitGather` class per route or wire format.

`UnitGather` all-gathers each rank's chunk as it is; `StreamedGather` feeds it from host memory
on a side stream (`CopyStream`); `QuantizedGather` carries int8 blockwise codes (qwZ,
`zero_quantized_weights`); `SecondaryGather` reads a secondary partition within each node (hpZ,
`zero_hpz_partition_size`). A new route or wire format is one more subclass. Imports nothing of
ours but `comm/codecs.py` (and `comm` for types); zero/unit_shards.py picks the gathers a
strategy uses, zero/stage3.py which of them each gather takes (Note: [exact gathers]).

qwZ: each rank quantises its chunk of a unit's flat buffer to int8 with one fp32 scale per
`block_numel` elements (comm/codecs.py, `DEFAULT_BLOCK_NUMEL` = 2048), then two all-gathers
carry the codes and the scales; on arrival every rank dequantises all the chunks (its own
too, so every rank computes with the same weights). Each chunk is quantised on its own, so a
block never straddles two ranks' chunks. Per element the gathered weight is off by at most
`amax_block / 254` (amax_block: the largest |w| of its block of 2048 in its owner's chunk),
plus the cast to the parameter dtype (bf16: a relative 2^-8). Bytes per gather: `n` int8
codes plus `4 * ceil(n_chunk / 2048)` per rank, against `2 n` in bf16/fp16 and `4 n` in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from zeroshard.comm.codecs import DEFAULT_BLOCK_NUMEL, Quantized, dequantize, quantize_int8

if TYPE_CHECKING:
    from zeroshard.comm import Comm, Handle


class PendingGather:
    """A gather made of several collectives and a local finish (dequantise, slice); `wait()`
    waits for the collectives, runs the finish once, and is then a no-op."""

    __slots__ = ("_handles", "_finish")

    def __init__(self, handles: Sequence["Handle | PendingGather | StreamWait"],
                 finish: Callable[[], None]) -> None:
        self._handles = list(handles)
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> None:
        if self._finish is None:
            return
        for h in self._handles:
            h.wait()
        finish, self._finish = self._finish, None
        finish()


class StreamWait:
    """A handle whose `wait()` makes the current stream wait for `event` (the host does not block)."""

    __slots__ = ("_event", "_device")

    def __init__(self, event: "torch.cuda.Event", device: torch.device) -> None:
        self._event, self._device = event, device

    def wait(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)


class CopyStream:
    """Host-to-device copies and their gathers on a side stream (Note: [copy stream]).

    Note: [copy stream]. With stage 3's shards in host memory and the model on a GPU, a unit's
    copy to the device and its gather are issued on a side stream, so a prefetch runs while the
    compute stream works on the unit before it (issued on the compute stream, the copy would wait
    for every kernel queued ahead of it). The device buffers are allocated on the compute stream
    before the side stream waits for it, so memory the compute stream just freed is not written
    early; the returned handle first makes the compute stream wait for the copy (a gather without
    a process group finishes with a copy on the current stream), then waits for the gather; and
    `synchronize` lets the step wait before the optimizer writes the host shards the copies read.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device)

    def gather(self, comm: "Comm", full: Tensor, src: Tensor) -> PendingGather:
        """`full` = every rank's `src` (a host tensor) gathered on the device, after `wait()`."""
        dst = torch.empty(src.shape, dtype=src.dtype, device=self._device)  # the compute stream's
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            handle = comm.all_gather(full, dst, async_op=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return PendingGather([StreamWait(done, self._device), handle], finish=lambda: None)

    def synchronize(self) -> None:
        self._stream.synchronize()


def quantized_all_gather(comm: "Comm", full: Tensor, mine: Tensor, *,
                         block_numel: int = DEFAULT_BLOCK_NUMEL) -> PendingGather:
    """qwZ: `full[r * k:(r + 1) * k]` = dequantised int8 codes of rank r's `mine` (k elements),
    on every rank of `comm`'s group, after `wait()`. `full` keeps its dtype (the parameters').

    The error bound and the byte count are in the module docstring.
    """
    world, k = comm.world_size, mine.numel()
    if full.numel() != world * k:
        raise AssertionError(f"expected full of {world} * {k} elements, got {full.numel()}")
    q = quantize_int8(mine, block_numel)
    nscales = q.scales.numel()
    codes = torch.empty(world * k, dtype=torch.int8, device=full.device)
    scales = torch.empty(world * nscales, dtype=torch.float32, device=full.device)
    handles = (comm.all_gather(codes, q.codes.to(full.device), async_op=True),
               comm.all_gather(scales, q.scales.to(full.device), async_op=True))

    def finish() -> None:
        for r in range(world):
            chunk = Quantized(codes=codes[r * k:(r + 1) * k], scales=scales[r * nscales:(r + 1) * nscales],
                              numel=k, block_numel=block_numel, bits=8)
            full[r * k:(r + 1) * k].copy_(dequantize(chunk))

    return PendingGather(handles, finish)


def quantized_gather_bytes(numel: int, world_size: int, block_numel: int = DEFAULT_BLOCK_NUMEL) -> int:
    """Bytes the comm log records for one qwZ gather of a flat buffer of `numel` elements
    (`world_size` equal chunks): the codes plus every chunk's scales.

    >>> quantized_gather_bytes(8192, 2)
    8208
    """
    k = numel // world_size
    return numel + world_size * 4 * -(-k // block_numel)


class SecondaryPartition:
    """hpZ: a second copy of each unit's parameters, partitioned over the ranks of one node,
    so the gathers of forward and backward run inside the node.

    With W ranks, s per node and N = W / s nodes, a unit's padded flat buffer is W chunks of
    k elements (the primary partition: chunk r on rank r). Rank r = n * s + l (node n, local
    rank l) keeps the N chunks l, s + l, ..., (N - 1) * s + l: exactly what the *cross* group
    of local rank l (one rank per node) holds, so the post-step refresh is one all-gather
    over the cross group (every byte of it crosses nodes, (N - 1) * k received per rank) and
    needs no full buffer. A training gather is one all-gather over the node group into a
    scratch buffer laid out [l][n][k], copied into the unit's buffer as [n][l][k].

    Memory: N * k = padded / s elements per unit (the primary shard is padded / W).
    """

    def __init__(self, node_comm: "Comm", cross_comm: "Comm", padded_numels: Sequence[int],
                 *, dtype: torch.dtype, device: torch.device, quantized: bool) -> None:
        self._node, self._cross, self._quantized = node_comm, cross_comm, quantized
        self._s, self._n = node_comm.world_size, cross_comm.world_size
        self._local = node_comm.rank
        world = self._s * self._n
        self._numel = [p // world * self._n for p in padded_numels]  # per unit: N chunks of k
        starts = [0]
        for n in self._numel:
            starts.append(starts[-1] + n)
        self._starts = starts
        self.shard = torch.empty(starts[-1], dtype=dtype, device=device)  # 1D, param dtype

    def _mine(self, u: int) -> Tensor:
        return self.shard[self._starts[u] : self._starts[u + 1]]

    def fill_from_full(self, u: int, full: Tensor) -> None:
        """Take this rank's secondary chunks from a unit's whole flat buffer (no communication)."""
        k = full.numel() // (self._s * self._n)
        self._mine(u).view(self._n, k).copy_(full.view(self._n, self._s, k)[:, self._local, :])

    def refresh(self, u: int, primary: Tensor) -> "Handle | PendingGather":
        """Start rebuilding unit `u`'s secondary chunks from every node's primary chunk (this
        rank's `primary`); int8 on the wire under qwZ. Async: wait before the next gather."""
        if self._quantized:
            return quantized_all_gather(self._cross, self._mine(u), primary)
        return self._cross.all_gather(self._mine(u), primary, async_op=True)

    def gather(self, u: int, full: Tensor) -> "Handle | PendingGather":
        """Start gathering unit `u` into `full` from the node's secondary chunks."""
        mine = self._mine(u)
        if self._n == 1:  # one node: the secondary layout is the primary one
            return self._node.all_gather(full, mine, async_op=True)
        scratch = torch.empty_like(full)
        handle = self._node.all_gather(scratch, mine, async_op=True)
        k = full.numel() // (self._s * self._n)

        def finish() -> None:
            full.view(self._n, self._s, k).copy_(scratch.view(self._s, self._n, k).transpose(0, 1))

        return PendingGather([handle], finish)


ChunkOf = Callable[[int], Tensor]
"""unit -> this rank's chunk of the unit where its shard lives (1-D, the parameters' dtype)."""


class UnitGather:
    """The plain route: each rank's chunk copied to the device and all-gathered as it is; the
    base of the other routes, whose hooks default to doing nothing.

    Args:
        comm: the data-parallel group.
        chunk: this rank's chunk of a unit, where the shard lives (zero/unit_shards.py).
        device: the model's device, where the full buffers live.
    """

    exact = True
    """The gathered values equal the shards (Note: [exact gathers] in zero/stage3.py)."""

    def __init__(self, comm: "Comm", chunk: ChunkOf, device: torch.device) -> None:
        self._comm, self._chunk, self._device = comm, chunk, device

    def _device_chunk(self, u: int) -> Tensor:
        return self._chunk(u).to(self._device, non_blocking=True)

    def start(self, u: int, full: Tensor) -> "Handle | PendingGather":
        """Start gathering unit `u` into `full` (its padded flat buffer, storage allocated)."""
        return self._comm.all_gather(full, self._device_chunk(u), async_op=True)

    def fill(self, u: int, full: Tensor) -> None:
        """Construction: unit `u`'s whole values are in `full`; keep what this route holds of
        them besides the primary shard (hpZ: the secondary chunks)."""

    def refresh(self, units: Iterable[int]) -> None:
        """The primary shards of `units` changed (a step, a load): rebuild what `fill` kept."""

    def synchronize(self) -> None:
        """Before the shards are written: no copy of this route may still be reading them."""

    def extra_bytes(self) -> int:
        """Device bytes this route keeps beyond the primary shard (hpZ's secondary partition)."""
        return 0


class StreamedGather(UnitGather):
    """Host-resident shards reach the GPU on a side stream (Note: [copy stream])."""

    def __init__(self, comm: "Comm", chunk: ChunkOf, device: torch.device) -> None:
        super().__init__(comm, chunk, device)
        self._copies = CopyStream(device)

    def start(self, u: int, full: Tensor) -> "Handle | PendingGather":
        return self._copies.gather(self._comm, full, self._chunk(u))

    def synchronize(self) -> None:
        self._copies.synchronize()


class QuantizedGather(UnitGather):
    """qwZ: int8 codes and fp32 block scales on the wire (`quantized_all_gather`)."""

    exact = False

    def start(self, u: int, full: Tensor) -> "Handle | PendingGather":
        return quantized_all_gather(self._comm, full, self._device_chunk(u))


class SecondaryGather(UnitGather):
    """hpZ: gathers read a secondary partition within the node (`SecondaryPartition`), rebuilt
    from the primary shards after each step (int8 on the wire under qwZ: then not exact).

    Args:
        secondary: the partition (every unit but `persistent` has chunks in it).
        persistent: the unit that never goes through this route (gathered exactly, once a step).
    """

    def __init__(self, comm: "Comm", chunk: ChunkOf, device: torch.device, *,
                 secondary: "SecondaryPartition", persistent: int, quantized: bool) -> None:
        super().__init__(comm, chunk, device)
        self._secondary, self._persistent = secondary, persistent
        self.exact = not quantized

    def start(self, u: int, full: Tensor) -> "Handle | PendingGather":
        return self._secondary.gather(u, full)

    def fill(self, u: int, full: Tensor) -> None:
        if u != self._persistent:
            self._secondary.fill_from_full(u, full)

    def refresh(self, units: Iterable[int]) -> None:
        """The only gathers of a training step that cross nodes (SecondaryPartition's docstring)."""
        pending = [self._secondary.refresh(u, self._device_chunk(u)) for u in units if u != self._persistent]
        for handle in pending:
            handle.wait()

    def extra_bytes(self) -> int:
        shard = self._secondary.shard
        return shard.numel() * shard.element_size()
