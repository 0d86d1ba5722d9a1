"""Stage 3's float8 route: the weights of float8 layers gathered as e4m3 codes, one byte each.

Note: [float8 gather] With `fp8.float8_all_gather` (tensorwise recipe, stage 3), a unit's gather
sends the elements of each float8 layer's weight as e4m3 codes and every other element (biases,
norms, weights of high-precision layers) in the parameters' dtype:
- Once per step, at the first gather after the optimizer wrote the shards (`refresh` marks them),
  each rank takes the amax of its part of every float8 weight, and one all-reduce (max) over all
  of them gives each weight's amax; its scale `448 / amax` is published on the parameter as
  `zs_float8_scale` (0-dim fp32) until the shards change again.
- A gather casts this rank's part of each float8 weight with that scale, all-gathers the codes
  (int8 bytes) and the other elements (compacted, padded to the largest rank's count), and
  writes `code / scale` into the unit's buffer in the parameters' dtype.
- The float8 layer (runtime/fp8.py) quantises with the published scale, and the gathered value
  rounds back to its code exactly: `(code / scale)` is within a relative 2^-9 of the code's value
  even in bf16, far inside half an e4m3 step (2^-4). The scale equals the one the layer would take
  from the whole weight (the max of the shards' amaxes is the whole tensor's amax), so the
  forward and both gradients are the same bits as with an exact gather; only the bytes on the
  wire change. The gathered *values* are not the shards' (a float8 grid), so the route is not
  exact (Note: [exact gathers] in zero/stage3.py): saves and user gathers take the exact route.
A float8 weight is one no other module uses (runtime/fp8.py marks it `zs_float8_weight`).

Imports zero/gather.py and comm/codecs.py only (and `comm` for types).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from zeroshard.comm.codecs import float8_scale, to_float8
from zeroshard.zero.gather import ChunkOf, PendingGather, UnitGather

if TYPE_CHECKING:
    from zeroshard.comm import Comm

E4M3 = torch.float8_e4m3fn

Segment = tuple[int, int, int]
"""(start, end, weight index) of a float8 weight in a unit's flat buffer."""


class _UnitLayout:
    """Where unit's float8 weights and other elements sit in its padded flat buffer of `numel`
    elements split into `world` equal chunks."""

    def __init__(self, segments: Sequence[Segment], numel: int, world: int, device: torch.device) -> None:
        self.segments = list(segments)
        self.chunk_numel = numel // world
        is_weight = torch.zeros(numel, dtype=torch.bool)
        for a, b, _ in segments:
            is_weight[a:b] = True
        others = [(~is_weight[r * self.chunk_numel:(r + 1) * self.chunk_numel]).nonzero().flatten()
                  for r in range(world)]
        self.counts = [len(o) for o in others]
        self.max_others = max(self.counts)
        self.my_others: list[Tensor] = [o.to(device) for o in others]  # indexed by rank
        self.other_positions = torch.cat([o + r * self.chunk_numel for r, o in enumerate(others)]).to(device)
        self.other_slots = torch.cat([torch.arange(n) + r * self.max_others for r, n in enumerate(self.counts)]
                                     ).to(device)


class Float8Gather(UnitGather):
    """Float8 weights as e4m3 codes on the wire (Note: [float8 gather]).

    Args:
        comm, chunk, device: as for `UnitGather`.
        segments: per unit, its float8 weights' (start, end, index) in its flat buffer.
        padded_numels: per unit, its flat buffer's padded size.
        weights: the float8 weight parameters, by index (their scales are published on them).
    """

    exact = False

    def __init__(self, comm: "Comm", chunk: ChunkOf, device: torch.device, *,
                 segments: Sequence[Sequence[Segment]], padded_numels: Sequence[int],
                 weights: Sequence[nn.Parameter]) -> None:
        super().__init__(comm, chunk, device)
        self._layouts = [_UnitLayout(s, n, comm.world_size, device) for s, n in zip(segments, padded_numels)]
        self._weights = list(weights)
        self._scales = torch.ones(len(self._weights), dtype=torch.float32, device=device)
        self._stale = True
        self.amax_reductions = 0
        """All-reduces of the weights' amaxes so far (one per step and per load)."""

    def refresh(self, units: Iterable[int]) -> None:
        """The shards changed (a step, a load, a user's write): the scales are recomputed before
        the next gather, from every unit's shards, with one all-reduce. Until then no scale is
        published, so a layer gathered exactly meanwhile computes its own."""
        self._stale = True
        for w in self._weights:
            w.zs_float8_scale = None

    def _compute_scales(self) -> None:
        rank = self._comm.rank
        amax = torch.zeros(len(self._weights), dtype=torch.float32, device=self._device)
        for u, layout in enumerate(self._layouts):
            if not layout.segments:
                continue
            lo_chunk = rank * layout.chunk_numel
            mine = self._device_chunk(u)
            for a, b, i in layout.segments:
                lo, hi = max(a, lo_chunk), min(b, lo_chunk + layout.chunk_numel)
                if lo < hi:
                    amax[i] = torch.maximum(amax[i], mine[lo - lo_chunk:hi - lo_chunk].detach().float().abs().amax())
        if self._comm.world_size > 1:
            self._comm.all_reduce(amax, op="max")
        self.amax_reductions += 1
        self._scales = float8_scale(amax, E4M3)
        for i, w in enumerate(self._weights):
            w.zs_float8_scale = self._scales[i]  # read by runtime/fp8.py's tensorwise layer
        self._stale = False

    def start(self, u: int, full: Tensor) -> PendingGather:
        if self._stale:
            self._compute_scales()
        layout, rank, world = self._layouts[u], self._comm.rank, self._comm.world_size
        n, lo_chunk = layout.chunk_numel, self._comm.rank * layout.chunk_numel
        mine = self._device_chunk(u)
        codes = torch.zeros(n, dtype=torch.int8, device=self._device)
        for a, b, i in layout.segments:
            lo, hi = max(a, lo_chunk), min(b, lo_chunk + n)
            if lo < hi:
                codes[lo - lo_chunk:hi - lo_chunk] = to_float8(mine[lo - lo_chunk:hi - lo_chunk], self._scales[i],
                                                               E4M3).view(torch.int8)
        others = mine.new_zeros(layout.max_others)
        others[:layout.counts[rank]] = mine[layout.my_others[rank]]
        all_codes = torch.empty(n * world, dtype=torch.int8, device=self._device)
        all_others = mine.new_empty(layout.max_others * world)
        handles = [self._comm.all_gather(all_codes, codes, async_op=True),
                   self._comm.all_gather(all_others, others, async_op=True)]

        def finish() -> None:
            values = all_codes.view(E4M3)
            for a, b, i in layout.segments:
                full[a:b] = (values[a:b].float() / self._scales[i]).to(full.dtype)
            full[layout.other_positions] = all_others[layout.other_slots]

        return PendingGather(handles, finish)

    def wire_bytes(self, u: int) -> int:
        """Bytes one rank sends for unit `u`: its codes and its (padded) other elements."""
        layout = self._layouts[u]
        return layout.chunk_numel + layout.max_others * self._chunk(u).element_size()
