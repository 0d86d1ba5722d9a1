"""The distributed data loader `initialize(training_data=...)` returns, with a resumable position."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class ResumableDistributedSampler(Sampler[int]):
    """This rank's share of one epoch's permutation, starting at a global position.

    The epoch's order is a permutation of the dataset seeded by `seed + epoch` (the same on
    every rank and at every world size), padded by repeating its start (or cut, with
    `drop_last`) to a multiple of the world size, as torch's `DistributedSampler` does. From
    global position `start` (samples all ranks consumed together), rank r takes every
    world_size-th sample from `start + r`: at the world size that saved `start`, exactly what
    the uninterrupted epoch would have given; at another, the rest re-fitted to the new size.
    """

    def __init__(self, dataset_len: int, *, rank: int, world_size: int, shuffle: bool, seed: int,
                 drop_last: bool) -> None:
        self.n, self.rank, self.world_size = dataset_len, rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def _indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        # The epoch as torch's DistributedSampler lays it out (so a resume at the same world
        # size continues the same sequence), then its part from `start` on.
        rest = self._fit(order, order)[self.start:]
        return self._fit(rest, rest)[self.rank :: self.world_size]  # resharded: re-fit the rest

    def _fit(self, seq: list[int], pad_from: list[int]) -> list[int]:
        """`seq` cut (drop_last) or padded from `pad_from` to a multiple of the world size."""
        extra = len(seq) % self.world_size
        if extra == 0 or not seq:
            return seq
        if self.drop_last:
            return seq[: len(seq) - extra]
        pad = self.world_size - extra
        return seq + (pad_from * (pad // len(pad_from) + 1))[:pad]

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices())

    def __len__(self) -> int:
        return len(self._indices())


class DistributedDataLoader:
    """Micro-batches of this rank's share of `dataset`, reshuffled every epoch.

    Each pass over the loader is one epoch; the sampler's epoch advances on every new
    iterator, so ranks stay in step and every epoch sees a new permutation (the same on all
    ranks for a given seed). `len()` is the number of micro-batches per rank per epoch.
    `state_dict()` records the epoch and how many samples all ranks have consumed in it; after
    `load_state_dict()` the next pass continues that epoch where it stopped (at any world size).
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
        self.sampler = ResumableDistributedSampler(
            len(dataset), rank=rank, world_size=world_size, shuffle=shuffle, seed=seed, drop_last=drop_last)  # type: ignore[arg-type]
        self._loader = DataLoader(
            dataset,
            batch_size=micro_batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            num_workers=num_workers,
            # Its own generator: starting a pass must not draw from the global torch RNG, or
            # a resumed run (which starts a new pass) would shift every later random draw.
            generator=torch.Generator().manual_seed(seed),
        )
        self._micro_batch_size, self._world_size = micro_batch_size, world_size
        self.epoch = 0
        self._resume_start = 0
        self._position: tuple[int, int] | None = None  # (epoch, global samples consumed) of a live pass

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        epoch, start = self.epoch, self._resume_start
        self.sampler.set_epoch(epoch, start)
        self.epoch += 1
        self._resume_start = 0
        return self._iterate(epoch, start)

    def _iterate(self, epoch: int, start: int) -> Iterator[Any]:
        self._position = (epoch, start)
        for batch in self._loader:
            start += self._micro_batch_size * self._world_size
            self._position = (epoch, start)
            yield batch
        self._position = None

    def state_dict(self) -> dict[str, int]:
        """The position: the epoch in progress and the samples all ranks consumed in it."""
        if self._position is None:
            return {"epoch": self.epoch, "consumed_samples": self._resume_start}
        epoch, consumed = self._position
        if consumed >= self.sampler.n:  # the last batch was taken: the next pass starts a new epoch
            return {"epoch": epoch + 1, "consumed_samples": 0}
        return {"epoch": epoch, "consumed_samples": consumed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from `state` on the next pass (`iter(loader)`)."""
        self.epoch = int(state["epoch"])
        self._resume_start = int(state["consumed_samples"])
        self._position = None


class RepeatingLoader:
    """Iterate over `loader` forever, restarting it at each end (DeepSpeed's RepeatingLoader).

    Example::

        batches = RepeatingLoader(loader)
        for step in range(steps):
            x, y = next(batches)
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self) -> "RepeatingLoader":
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
