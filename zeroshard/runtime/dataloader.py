"""The distributed data loader `initialize(training_data=...)` returns."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler


class DistributedDataLoader:
    """Micro-batches of this rank's share of `dataset`, reshuffled every epoch.

    Each pass over the loader is one epoch; the sampler's epoch advances on every new
    iterator, so ranks stay in step and every epoch sees a new permutation (the same on all
    ranks for a given seed). `len()` is the number of micro-batches per rank per epoch.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int = 0,
    ) -> None:
        self.sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self._loader = DataLoader(
            dataset,
            batch_size=micro_batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            num_workers=num_workers,
        )
        self.epoch = 0

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self._loader)
