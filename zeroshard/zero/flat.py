"""Flat buffers: packing parameters into one contiguous range, partitions and buckets.

Vocabulary used across zeroshard/zero (the words mean the same thing everywhere):

- *flat buffer*: one contiguous 1-D tensor holding many parameters (or their gradients)
  back to back, in a fixed order, padded at the end so it splits evenly.
- *partition*: the plan of which rank owns which `[start, end)` range of a flat buffer.
  A partition may cut a parameter; a *fragment* is the piece of one parameter inside one range.
- *shard*: the tensor a rank actually holds for its partition.
- *bucket*: a contiguous range of the gradient flat buffer that is reduced by one collective,
  launched as soon as every gradient inside it is ready during backward.
- *unit*: a module whose parameters are gathered together (stage 3).

This module is pure arithmetic on sizes (no process group, no torch.distributed), so every
rule here is tested with world sizes as plain ints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class Fragment:
    """The piece of parameter `param_index` that lies in one range of a flat buffer."""

    param_index: int
    param_offset: int
    """Offset (elements) of the fragment inside the flattened parameter."""
    flat_offset: int
    """Offset (elements) of the fragment inside the flat buffer."""
    numel: int


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter lives in a flat buffer, and how the buffer splits over ranks.

    Parameters are packed in the given order with no gaps; only the end of the buffer is
    padded, so that `padded_numel` is a multiple of `world_size * align` and every rank's
    partition has the same size, a multiple of `align` elements (aligned starts keep
    vectorised kernels and collectives on their fast paths).
    """

    numels: tuple[int, ...]
    world_size: int = 1
    align: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.align < 1:
            raise ValueError(f"world_size and align must be >= 1, got {self.world_size}, {self.align}")
        if any(n < 0 for n in self.numels):
            raise ValueError(f"parameter sizes must be >= 0, got {self.numels}")

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for n in self.numels:
            out.append(acc)
            acc += n
        return tuple(out)

    @property
    def numel(self) -> int:
        """Elements used by parameters (without padding)."""
        return sum(self.numels)

    @property
    def padded_numel(self) -> int:
        return max(_round_up(self.numel, self.world_size * self.align), self.world_size * self.align)

    @property
    def partition_numel(self) -> int:
        return self.padded_numel // self.world_size

    def partition(self, rank: int) -> tuple[int, int]:
        """`[start, end)` of `rank`'s partition in the flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        return rank * self.partition_numel, (rank + 1) * self.partition_numel

    def fragments(self, start: int, end: int) -> list[Fragment]:
        """Fragments of every parameter overlapping the flat range `[start, end)`."""
        frags = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(start, off), min(end, off + n)
            if lo < hi:
                frags.append(Fragment(i, lo - off, lo, hi - lo))
        return frags

    def rank_fragments(self, rank: int) -> list[Fragment]:
        return self.fragments(*self.partition(rank))


def plan_buckets(numels: Sequence[int], bucket_numel: int) -> list[tuple[int, int]]:
    """Split params laid out back to back into buckets of at most `bucket_numel` elements.

    Returns `[(first_param, last_param_exclusive), ...]`. A bucket always holds whole
    parameters; a parameter larger than `bucket_numel` gets a bucket of its own (splitting it
    would delay its reduction until the whole parameter's gradient is ready anyway).
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be >= 1 element, got {bucket_numel}")
    buckets: list[tuple[int, int]] = []
    first, filled = 0, 0
    for i, n in enumerate(numels):
        if i > first and filled + n > bucket_numel:
            buckets.append((first, i))
            first, filled = i, 0
        filled += n
    if first < len(numels):
        buckets.append((first, len(numels)))
    return buckets


def param_views(flat: Tensor, layout: FlatLayout, shapes: Sequence[torch.Size]) -> list[Tensor]:
    """Views of `flat` shaped like each parameter (no copy)."""
    return [
        flat.narrow(0, off, n).view(shape)
        for off, n, shape in zip(layout.offsets, layout.numels, shapes)
    ]


@dataclass(frozen=True, slots=True)
class ShardFragment:
    """The piece of parameter `param_index` owned by one rank, and where it lives."""

    param_index: int
    param_offset: int
    """Offset (elements) inside the flattened parameter."""
    flat_offset: int
    """Offset (elements) inside the whole padded flat buffer."""
    shard_offset: int
    """Offset (elements) inside the owning rank's shard."""
    numel: int
    bucket: int


class BucketedPartition:
    """Parameters packed bucket after bucket; every bucket split evenly over the ranks.

    The flat buffer is the concatenation of the buckets, each a `FlatLayout` padded to
    `world_size * align`. Rank r owns chunk r of every bucket, and its shard is the
    concatenation of those chunks. A bucket is then reduce-scattered or all-gathered by one
    even collective as soon as its gradients are ready, with no re-packing, while the ranks
    still own the same share of every bucket (so a parameter is cut across ranks only at
    chunk boundaries inside its bucket).
    """

    def __init__(self, numels: Sequence[int], *, bucket_numel: int = 0, world_size: int, align: int = 1,
                 buckets: Sequence[tuple[int, int]] | None = None) -> None:
        """Buckets are planned by size (`bucket_numel`) unless given explicitly as param ranges."""
        self.numels = tuple(numels)
        self.world_size = world_size
        self.buckets = list(buckets) if buckets is not None else plan_buckets(self.numels, bucket_numel)
        self.layouts = [FlatLayout(self.numels[a:b], world_size, align) for a, b in self.buckets]
        self.flat_offsets, self.shard_offsets = [], []
        flat = shard = 0
        for layout in self.layouts:
            self.flat_offsets.append(flat)
            self.shard_offsets.append(shard)
            flat += layout.padded_numel
            shard += layout.partition_numel
        self.padded_numel, self.shard_numel = flat, shard
        self.param_flat_offsets = [
            self.flat_offsets[b] + off
            for b, layout in enumerate(self.layouts)
            for off in layout.offsets
        ]

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def bucket_range(self, bucket: int) -> tuple[int, int]:
        """`[start, end)` of a bucket in the flat buffer."""
        start = self.flat_offsets[bucket]
        return start, start + self.layouts[bucket].padded_numel

    def chunk_range(self, bucket: int, rank: int) -> tuple[int, int]:
        """`[start, end)` in the flat buffer of `rank`'s chunk of `bucket`."""
        lo, hi = self.layouts[bucket].partition(rank)
        return self.flat_offsets[bucket] + lo, self.flat_offsets[bucket] + hi

    def shard_range(self, bucket: int) -> tuple[int, int]:
        """`[start, end)` of a bucket's chunk inside a rank's shard (the same on every rank)."""
        start = self.shard_offsets[bucket]
        return start, start + self.layouts[bucket].partition_numel

    def rank_fragments(self, rank: int) -> list[ShardFragment]:
        out = []
        for b, ((first, _), layout) in enumerate(zip(self.buckets, self.layouts)):
            chunk_start = layout.partition(rank)[0]
            for f in layout.rank_fragments(rank):
                out.append(ShardFragment(
                    param_index=first + f.param_index,
                    param_offset=f.param_offset,
                    flat_offset=self.flat_offsets[b] + f.flat_offset,
                    shard_offset=self.shard_offsets[b] + f.flat_offset - chunk_start,
                    numel=f.numel,
                    bucket=b,
                ))
        return out
