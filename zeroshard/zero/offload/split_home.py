"""Partial optimizer offload (`offload_optimizer.ratio` below 1.0): a rank's flat optimizer buffer
in two tensors, its leading buckets on the model's device and the rest at the offload home.

Note: [partial offload] DeepSpeed 0.19.8 (stage 3) keeps the optimizer sub-groups i <
int((1 - ratio) * n) of n on the accelerator and offloads the others to the CPU. zeroshard's
stage 3 has no sub-groups but buckets (one per unit, in unit order), so the same rule picks
buckets: the first int((1 - ratio) * n) units' master weights, gradient shard and optimizer state
stay on the model's device, the rest live at the offload home. The update rule is unchanged (one
torch optimizer steps both parts; torch groups its kernels by device). Imports nothing of
zeroshard.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def device_buckets(ratio: float, buckets: int) -> int:
    """How many leading buckets stay on the model's device (Note: [partial offload])."""
    return int((1 - ratio) * buckets)


class SplitFlat:
    """A 1-D buffer of `numel` elements: [0, split) in `parts[0]`, [split, numel) in `parts[1]`.

    Sliced like a tensor, as long as a slice stays inside one part (a bucket's range always does).
    """

    def __init__(self, numel: int, split: int, first: Callable[[int], Tensor], second: Callable[[int], Tensor]) -> None:
        if not 0 <= split <= numel:
            raise AssertionError(f"expected a split in [0, {numel}], got {split}")
        self.split, self._numel = split, numel
        self.parts = (first(split), second(numel - split))

    def __getitem__(self, s: slice) -> Tensor:
        start, stop = s.start or 0, self._numel if s.stop is None else s.stop
        if stop <= self.split:
            return self.parts[0][start:stop]
        if start >= self.split:
            return self.parts[1][start - self.split : stop - self.split]
        raise AssertionError(f"a slice [{start}, {stop}) across the split at {self.split} of a partial offload")

    def numel(self) -> int:
        return self._numel

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[1].dtype

    def __repr__(self) -> str:
        first, second = self.parts
        return f"SplitFlat({self.split} on {first.device}, {self._numel - self.split} on {second.device})"


def parts_of(buffer: "Tensor | SplitFlat | None") -> list[Tensor]:
    """The tensors holding `buffer` (none for None)."""
    if buffer is None:
        return []
    return list(buffer.parts) if isinstance(buffer, SplitFlat) else [buffer]
