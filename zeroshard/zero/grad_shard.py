"""A rank's gradient shard: one flat tensor kept for the whole run, or one tensor per bucket
whose storage exists only from its first reduction of a step until the optimizer step ends.

Note: [gradient lifetime] DeepSpeed keeps the fp32 gradient partition allocated for the whole
run, so it is resident during forward, when activations peak. FSDP2 creates a parameter's
sharded gradient in its post-backward and frees it at `zero_grad(set_to_none=True)`: no
gradient memory exists between the optimizer step and the next backward.
`zero_optimization.stage3_release_grads` gives stage 3 FSDP2's lifetime. Each bucket (a stage-3
unit) then owns its own tensor; `bucket(b)` materialises it (zeroed) when the reducer first
folds into it in a step, and `release()` after the step resizes every storage to 0 bytes, so
the fragments' gradient views stay valid objects that hold nothing; the reducer frees its pool
of staging blocks at the same point (`GradReducer.end_step(release_pool=True)`). The values are the same
either way: the reducer's first fold of a step copies and later ones add (zero/reduce.py).
Only a shard on the model's device is released: an offloaded one is host memory that the
device never holds.

Imports nothing of ours but zero/flat.py and zero/offload/split_home.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from zeroshard.zero.flat import BucketedPartition, ShardFragment
from zeroshard.zero.offload.split_home import SplitFlat, parts_of


class GradShard:
    """This rank's gradient shard, addressed per bucket (see Note: [gradient lifetime]).

    Args:
        plan: the bucketed partition; bucket b's piece is `plan.shard_range(b)` of the shard.
        allocate_flat: the whole shard, kept for the run (a tensor, or split between the device and
            the offload home with `offload_optimizer.ratio`, zero/offload/split_home.py).
        allocate_piece: one bucket's own tensor of n elements (`release`).
        release: give each bucket its own storage and release it after every step.
    """

    def __init__(self, plan: BucketedPartition, allocate_flat: Callable[[], "Tensor | SplitFlat"],
                 allocate_piece: Callable[[int], Tensor], *, release: bool) -> None:
        self._plan = plan
        ranges = [plan.shard_range(b) for b in range(len(plan.buckets))]
        self.released_after_step = release
        self.flat: Tensor | SplitFlat | None = None
        if release:  # allocated now so that views can be taken; the owner calls `release()` after
            self._pieces = [allocate_piece(end - start) for start, end in ranges]
        else:
            flat = self.flat = allocate_flat()
            self._pieces = [flat[start:end] for start, end in ranges]
        self._live = [True] * len(ranges)

    @property
    def dtype(self) -> torch.dtype:
        return self._pieces[0].dtype if self._pieces else torch.float32

    def bucket(self, b: int) -> Tensor:
        """Bucket `b`'s piece, materialised (zeroed) if the last step released it."""
        if not self._live[b]:
            piece = self._pieces[b]
            piece.untyped_storage().resize_(piece.numel() * piece.element_size())
            piece.zero_()
            self._live[b] = True
        return self._pieces[b]

    def fragment(self, f: ShardFragment) -> Tensor:
        """The view of fragment `f`'s gradient; taken before the first `release()` (a view cannot be
        made of released storage), it sees the values whenever its bucket holds storage."""
        start = f.shard_offset - self._plan.shard_range(f.bucket)[0]
        return self._pieces[f.bucket][start : start + f.numel]

    def views(self) -> list[Tensor]:
        """Every piece holding this step's gradients (the whole shard unless released)."""
        if self.flat is not None:
            return parts_of(self.flat)
        return [p for p, live in zip(self._pieces, self._live) if live]

    def release(self) -> None:
        """After the optimizer step: free every piece's storage (no-op for a kept flat shard)."""
        if not self.released_after_step:
            return
        for piece in self._pieces:
            piece.untyped_storage().resize_(0)
        self._live = [False] * len(self._pieces)

    def tensors(self) -> list[Tensor]:
        """The tensors holding storage now (for `offload_states` and the census)."""
        return self.views()

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return sum(t.numel() * t.element_size() for t in self.views())
