"""The 1-bit all-reduce of the 1-bit optimizers (1-bit Adam; DeepSpeed's `compressed_allreduce`).

Each rank holds a list of fp32 tensors (*segments*: its momentum, one per parameter); every rank
ends with the same estimate of their average over ranks, sent as signs, in two phases, each
with error feedback and one scale per segment (as DeepSpeed, which compresses each parameter
on its own):

1. *worker*: `c_r = x_r + e_r` (the rank's worker error), sent as `scale_r * sign(c_r)`; the
   rank keeps `e_r = c_r - scale_r * sign(c_r)`. Each segment's packed signs are cut into
   `world_size` equal chunks and exchanged with one all-to-all for all segments (chunk s goes to
   rank s), the scales with one all-gather.
2. *server*: rank s averages the chunks it received, `a_s = mean_r(scale_r * sign(c_r)[chunk s])`,
   adds its server error `f_s`, and sends `d_s = a_s + f_s` as signs and one scale per segment
   with one all-gather (and one for the scales), keeping `f_s = d_s - scale * sign(d_s)`.
   Every rank decodes the gathered chunks.

Four collectives per step whatever the number of parameters (DeepSpeed issues four per
parameter). Scale: `||c||_2 / sqrt(n)` (DeepSpeed's; `pack_signs(scale_rule="rms")`, where the
measurement that chose it is).

Invariant (tests/unit/test_onebit.py): with errors starting at zero, the sum of the outputs
over T calls equals the sum of the averaged inputs minus `mean_r(e_r)` minus the server errors
`f` (each on its chunk), all at step T: nothing the signs fail to carry is lost.

Wire bytes per rank, for n elements in P segments (each padded to a multiple of 8 * world_size):
the all-to-all sends `(w - 1)/w * n/8` bytes and the all-gather `(w - 1)/w * n/8`, the scales
`2 (w - 1) * 4P`, against `2 (w - 1)/w * 4n` for a ring all-reduce of fp32: 1/32 plus the scales
(`wire_bytes`, bench/onebit.md). The padding is sent but carries no error: its residual is
dropped each call so that the errors have exactly the tensor's length (checkpoints keep them
per parameter).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from zeroshard.comm.codecs import SCALE_BYTES, SignPacked, pack_signs, unpack_signs

if TYPE_CHECKING:
    from zeroshard.comm import Comm

SCALE_RULE = "rms"
"""DeepSpeed's scale, ||c|| / sqrt(n): see `pack_signs`."""


def wire_bytes(numels: Sequence[int], world_size: int) -> float:
    """Bytes one rank sends for one 1-bit all-reduce of segments of `numels` elements."""
    if world_size == 1:
        return 0.0
    frac = (world_size - 1) / world_size
    signs = sum(padded_numel(n, world_size) for n in numels) / 8
    return 2 * frac * signs + 2 * (world_size - 1) * SCALE_BYTES * len(numels)


def padded_numel(numel: int, world_size: int) -> int:
    """`numel` rounded up so it splits into `world_size` chunks of whole bytes of signs."""
    unit = 8 * world_size
    return math.ceil(numel / unit) * unit


def chunk_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """`[start, end)` of the chunk rank `rank` serves, clipped to the unpadded `numel`."""
    chunk = padded_numel(numel, world_size) // world_size
    return min(numel, rank * chunk), min(numel, (rank + 1) * chunk)


def worker_compress(x: Tensor, worker_error: Tensor, padded: int) -> SignPacked:
    """Phase 1 on one rank: pack `x + worker_error` (zero-padded to `padded`) as signs and one
    scale; update `worker_error` (1D fp32, `x.numel()` elements) in place."""
    numel = x.numel()
    c = torch.zeros(padded, dtype=torch.float32, device=x.device)
    c[:numel] = x.reshape(-1)
    c[:numel] += worker_error
    packed = pack_signs(c, SCALE_RULE)
    # c - scale * sign(c), zero counting as +1 as in the packing (cheaper than unpacking).
    head = c[:numel]
    worker_error.copy_(head).sub_(torch.where(head >= 0, packed.scale, -packed.scale))
    return packed


def server_combine(bits: Tensor, scales: Tensor, server_error: Tensor) -> SignPacked:
    """Phase 2 on one rank: average the `world_size` chunks received (`bits`: [w, chunk/8]
    uint8, `scales`: [w] fp32), add the server error and pack again. `server_error` (1D fp32,
    the chunk's length, padding excluded) is updated in place."""
    w, nbytes = bits.shape
    chunk = nbytes * 8
    avg = torch.zeros(chunk, dtype=torch.float32, device=bits.device)
    for r in range(w):
        avg += unpack_signs(SignPacked(bits=bits[r], scale=scales[r], numel=chunk))
    avg /= w
    keep = server_error.numel()
    avg[:keep] += server_error
    if keep < chunk:
        avg[keep:] = 0.0  # padding: carries nothing and keeps no error
    packed = pack_signs(avg, SCALE_RULE)
    head = avg[:keep]
    server_error.copy_(head).sub_(torch.where(head >= 0, packed.scale, -packed.scale))
    return packed


def decode(bits: Tensor, scales: Tensor, numel: int) -> Tensor:
    """Every chunk's signs times its server's scale, concatenated, first `numel` elements."""
    w, nbytes = bits.shape
    parts = [unpack_signs(SignPacked(bits=bits[r], scale=scales[r], numel=nbytes * 8)) for r in range(w)]
    return torch.cat(parts)[:numel]


class SignAllReduce:
    """Error-feedback 1-bit average over `comm`'s group of a fixed list of fp32 segments.

    Args:
        numels: elements of each segment (one per parameter), the same every call.
        comm: collectives on the data-parallel group.
        device: where the errors live.

    Attributes:
        worker_errors: per segment, 1D fp32: what this rank's signs failed to carry so far.
        server_errors_full: per segment, 1D fp32 of the segment's length: zero outside this
            rank's chunk (`chunk_range`), where it holds what the server phase failed to carry.
            Kept at full length (DeepSpeed keeps the chunk only) so that the optimizer can keep
            both errors as per-parameter state, which checkpoints save like any elementwise state.
    """

    def __init__(self, numels: Sequence[int], comm: "Comm", device: torch.device) -> None:
        self.numels = list(numels)
        self._comm = comm
        self.world_size = w = comm.world_size
        self.padded = [padded_numel(n, w) for n in self.numels]
        self._chunk_bytes = [p // w // 8 for p in self.padded]  # per segment, bytes of one chunk
        self._chunks = [chunk_range(n, w, comm.rank) for n in self.numels]
        self.worker_errors = [torch.zeros(n, dtype=torch.float32, device=device) for n in self.numels]
        self.server_errors_full = [torch.zeros(n, dtype=torch.float32, device=device) for n in self.numels]

    def __repr__(self) -> str:
        return (f"SignAllReduce({len(self.numels)} segments, {sum(self.numels)} elements, "
                f"world size {self.world_size}, {wire_bytes(self.numels, self.world_size):.0f} B/rank/call)")

    @torch.no_grad()
    def average(self, xs: Sequence[Tensor]) -> list[Tensor]:
        """The 1-bit estimates of the averages over ranks of `xs` (one per segment), new 1D fp32."""
        if [x.numel() for x in xs] != self.numels:
            raise ValueError(f"SignAllReduce.average: got segments of {[x.numel() for x in xs]} elements, "
                             f"expected {self.numels}")
        w, comm, device = self.world_size, self._comm, xs[0].device
        sent = [worker_compress(x, e, p) for x, e, p in zip(xs, self.worker_errors, self.padded)]
        # [destination rank, segment chunk bytes...]: row s holds chunk s of every segment.
        send = torch.cat([p.bits.view(w, -1) for p in sent], dim=1).reshape(-1)
        received = torch.empty_like(send)
        comm.all_to_all(received, send)
        worker_scales = torch.empty(w * len(sent), dtype=torch.float32, device=device)
        comm.all_gather(worker_scales, torch.stack([p.scale.float() for p in sent]))
        rows = received.view(w, -1).split(self._chunk_bytes, dim=1)
        scales = worker_scales.view(w, -1)
        served = []
        for i, (bits, (start, end)) in enumerate(zip(rows, self._chunks)):
            served.append(server_combine(bits, scales[:, i], self.server_errors_full[i][start:end]))
        gathered = torch.empty(send.numel(), dtype=torch.uint8, device=device)
        comm.all_gather(gathered, torch.cat([p.bits for p in served]))
        server_scales = torch.empty(w * len(served), dtype=torch.float32, device=device)
        comm.all_gather(server_scales, torch.stack([p.scale.float() for p in served]))
        out_rows = gathered.view(w, -1).split(self._chunk_bytes, dim=1)
        out_scales = server_scales.view(w, -1)
        return [decode(bits, out_scales[:, i], n) for i, (bits, n) in enumerate(zip(out_rows, self.numels))]
