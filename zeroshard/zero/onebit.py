"""The 1-bit all-reduce of the 1-bit optimizers (1-bit Adam; DeepSpeed's `compressed_allreduce`).

Each rank holds a flat fp32 tensor `x_r` (its momentum); every rank ends with the same estimate
of their average, sent as signs, in two phases, each with error feedback:

1. *worker*: `c_r = x_r + e_r` (the rank's worker error), sent as `scale_r * sign(c_r)`; the
   rank keeps `e_r = c_r - scale_r * sign(c_r)`. The packed signs are cut into `world_size`
   equal chunks and exchanged with one all-to-all (chunk s goes to rank s), the scales with an
   all-gather of one fp32 each.
2. *server*: rank s averages the chunks it received, `a_s = mean_r(scale_r * sign(c_r)[chunk s])`,
   adds its server error `f_s`, and sends `d_s = a_s + f_s` as signs and one scale with an
   all-gather, keeping `f_s = d_s - scale * sign(d_s)`. Every rank decodes the gathered chunks.

Scale: `mean |c|` per tensor (zero/quant.py `pack_signs`, the least-squares scale, whose
residual never exceeds the input); DeepSpeed uses `||c||_2 / sqrt(n)`. See
docs/deepspeed-differences.md.

Invariant (tests/unit/test_onebit.py): with errors starting at zero, the sum of the outputs
over T calls equals the sum of the averaged inputs minus `mean_r(e_r)` minus the server errors
`f` (each on its chunk), all at step T; the errors stay bounded, so the per-step average is
carried exactly in the long run.

Wire bytes per rank, for n elements (padded to a multiple of 8 * world_size): the all-to-all
sends `(w - 1)/w * n/8` bytes and the all-gather `(w - 1)/w * n/8`: `2 (w - 1)/w * n/8`, against
`2 (w - 1)/w * 4n` for a ring all-reduce of fp32: 1/32 (bench/onebit.md). The padding is sent
but carries no error: its residual is dropped each call so that the errors have exactly the
tensor's length (checkpoints keep them per parameter).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from zeroshard.zero.quant import SignPacked, pack_signs, unpack_signs

if TYPE_CHECKING:
    from zeroshard.comm import Comm


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
    packed = pack_signs(c)
    worker_error.copy_(c[:numel] - unpack_signs(packed)[:numel])
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
    packed = pack_signs(avg)
    server_error.copy_(avg[:keep] - unpack_signs(packed)[:keep])
    return packed


def decode(bits: Tensor, scales: Tensor, numel: int) -> Tensor:
    """Every chunk's signs times its server's scale, concatenated, first `numel` elements."""
    w, nbytes = bits.shape
    parts = [unpack_signs(SignPacked(bits=bits[r], scale=scales[r], numel=nbytes * 8)) for r in range(w)]
    return torch.cat(parts)[:numel]


class SignAllReduce:
    """Error-feedback 1-bit average of one flat fp32 tensor of fixed length over `comm`'s group.

    Args:
        numel: elements of the tensor averaged each call.
        comm: collectives on the data-parallel group.
        device: where the errors live.

    Attributes:
        worker_error: 1D fp32 (`numel`): what this rank's signs failed to carry so far.
        server_error_full: 1D fp32 (`numel`): zero outside this rank's chunk (`chunk_range`),
            where it holds what the server phase failed to carry. Kept at full length (DeepSpeed
            keeps the chunk only) so that the optimizer can hold both errors as per-parameter
            views, which checkpoints save and restore like any elementwise state.
        server_error: the view of `server_error_full` on this rank's chunk.
    """

    def __init__(self, numel: int, comm: "Comm", device: torch.device) -> None:
        self.numel = numel
        self._comm = comm
        self.world_size = comm.world_size
        self.padded_numel = padded_numel(numel, self.world_size)
        start, end = chunk_range(numel, self.world_size, comm.rank)
        self.chunk = (start, end)
        self.worker_error = torch.zeros(numel, dtype=torch.float32, device=device)
        self.server_error_full = torch.zeros(numel, dtype=torch.float32, device=device)
        self.server_error = self.server_error_full[start:end]

    def __repr__(self) -> str:
        return (f"SignAllReduce({self.numel} elements, padded {self.padded_numel}, "
                f"world size {self.world_size}, chunk {self.chunk})")

    @torch.no_grad()
    def average(self, x: Tensor) -> Tensor:
        """The 1-bit estimate of the average over ranks of `x` (1D, `numel`), a new fp32 tensor."""
        if x.numel() != self.numel:
            raise ValueError(f"SignAllReduce.average: got {x.numel()} elements, expected {self.numel}")
        w, comm = self.world_size, self._comm
        device = x.device
        mine = worker_compress(x, self.worker_error, self.padded_numel)
        received = torch.empty_like(mine.bits)
        comm.all_to_all(received, mine.bits)
        worker_scales = torch.empty(w, dtype=torch.float32, device=device)
        comm.all_gather(worker_scales, mine.scale.reshape(1).float())
        served = server_combine(received.view(w, -1), worker_scales, self.server_error)
        gathered = torch.empty(served.bits.numel() * w, dtype=torch.uint8, device=device)
        comm.all_gather(gathered, served.bits)
        server_scales = torch.empty(w, dtype=torch.float32, device=device)
        comm.all_gather(server_scales, served.scale.reshape(1).float())
        return decode(gathered.view(w, -1), server_scales, self.numel)
