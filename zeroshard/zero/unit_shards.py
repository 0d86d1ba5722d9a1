"""Stage 3's parameter storage: where this rank's shard lives, how a unit becomes full, and each
unit's full flat buffer between gathers. zero/stage3.py decides *when* to gather and release.

- `ShardHome`: where the low-precision shard lives between gathers; one class per home:
  `InMemoryShard` (the model's device, or host memory with `offload_param.device: "cpu"`) and
  `MappedParamShard` (zero/offload/nvme_params.py, `"nvme"`: a memory-mapped swap file).
- `UnitGather` (zero/gather.py): how a unit's chunks become its full buffer; one class per
  route or wire format (plain, side-stream copies, qwZ int8 codes, hpZ secondary partition;
  float8 weights as e4m3 codes in zero/float8_gather.py).
- `UnitShards` owns one home and two gathers: the exact one and the one training uses.
- `UnitBuffer`: one unit's padded flat buffer and its gather state (FSDP2's `FSDPParam` keeps
  one parameter's sharded and unsharded life; here the shard side is `UnitShards`, the
  unsharded side a `UnitBuffer` per unit).

Imports zero/ only (zero/offload/nvme_* on first use of an NVMe home), and `comm` for types.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import Enum
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from zeroshard.zero.flat import BucketedPartition
from zeroshard.zero.float8_gather import Float8Gather, Segment
from zeroshard.zero.gather import QuantizedGather, SecondaryGather, SecondaryPartition, StreamedGather, UnitGather
from zeroshard.zero.offload.policy import OffloadPolicy
from zeroshard.zero.strategy import BytesByHome

if TYPE_CHECKING:
    from zeroshard.comm import Comm, Handle
    from zeroshard.zero.gather import PendingGather


class ShardHome(Protocol):
    """Where a rank's low-precision parameter shard lives between gathers."""

    tensor: Tensor
    """The shard (1-D, the parameters' dtype): the gathers read it, the optimizer writes it."""

    def use(self, start: int, end: int) -> None:
        """Elements `[start, end)` are about to be read (an NVMe home reads them ahead)."""
        ...

    def evict_all(self) -> None:
        """Every element was written (the step) or filled: an NVMe home writes it back and
        drops it from memory until the next `use`."""
        ...


class InMemoryShard:
    """The shard in memory: on the model's device, or in (pinned) host memory when offloaded."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor

    def use(self, start: int, end: int) -> None:
        """Always resident: nothing to read ahead."""

    def evict_all(self) -> None:
        """Always resident: nothing to write back."""


def open_shard_home(policy: OffloadPolicy, numel: int, dtype: torch.dtype, device: torch.device, *,
                    rank: int) -> ShardHome:
    """The home `offload_param` names for a `numel`-element shard. An NVMe directory is checked
    now, before any step (Note: [parameters on NVMe] in zero/offload/nvme_params.py)."""
    nvme = policy.nvme
    if nvme is None:
        return InMemoryShard(policy.allocate(numel, dtype, device))
    from zeroshard.zero.offload.nvme_io import check_swap_dir
    from zeroshard.zero.offload.nvme_params import MappedParamShard

    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    root = check_swap_dir(nvme.path, nbytes, key=nvme.key, direct=None)
    return MappedParamShard(root, numel, dtype, rank=rank, max_in_cpu=nvme.max_in_cpu)


class UnitShards:
    """This rank's low-precision shard of every unit: its home, and the gathers that make a
    unit full (Note: [exact gathers] in zero/stage3.py says which gather takes which route).

    Args:
        plan: the units' bucketed partition (unit u = bucket u).
        comm: the data-parallel group. `rank`: this rank.
        home: where the shard lives (`open_shard_home`). `device`: the model's device.
        persistent: the unit that always gathers exactly (and has no secondary copy).
        quantized: qwZ, int8 codes on the wire for the gathers of forward and backward.
        secondary: hpZ's secondary partition, or None.
        float8: `fp8.float8_all_gather`: each unit's float8 weight segments and the weights
            (zero/float8_gather.py), or None.
    """

    def __init__(self, plan: BucketedPartition, comm: "Comm", *, rank: int, home: ShardHome,
                 device: torch.device, persistent: int, quantized: bool,
                 secondary: SecondaryPartition | None,
                 float8: tuple[list[list[Segment]], list[torch.nn.Parameter]] | None = None) -> None:
        self._plan, self._rank, self.home, self._persistent = plan, rank, home, persistent
        on_host = device.type == "cuda" and home.tensor.device.type == "cpu"
        self._exact = (StreamedGather if on_host else UnitGather)(comm, self.chunk, device)
        self._training: UnitGather = self._exact
        if secondary is not None:
            self._training = SecondaryGather(comm, self.chunk, device, secondary=secondary,
                                             persistent=persistent, quantized=quantized)
        elif quantized:
            self._training = QuantizedGather(comm, self.chunk, device)
        elif float8 is not None:
            self._training = Float8Gather(comm, self.chunk, device, segments=float8[0], weights=float8[1],
                                          padded_numels=[layout.padded_numel for layout in plan.layouts])

    @property
    def shard(self) -> Tensor:
        """This rank's shard of every unit (1-D), addressed by `plan.shard_range(u)`."""
        return self.home.tensor

    def chunk(self, u: int) -> Tensor:
        """This rank's chunk of unit `u` where the shard lives (an NVMe home reads it ahead)."""
        start, end = self._plan.shard_range(u)
        self.home.use(start, end)
        return self.home.tensor[start:end]

    def gather_for(self, u: int, exact: bool) -> UnitGather:
        """The route unit `u` takes: the exact one when asked or for the persistent unit."""
        return self._exact if exact or u == self._persistent else self._training

    def fill(self, u: int, full: Tensor) -> None:
        """Construction: take this rank's chunk (and any secondary copy) of unit `u` from its
        whole values `full`."""
        mine = full[slice(*self._plan.layouts[u].partition(self._rank))]
        self.home.tensor[slice(*self._plan.shard_range(u))].copy_(mine)
        self._training.fill(u, full)

    def write(self, u: int, full: Tensor) -> Tensor:
        """Unit `u`'s whole values `full` became the truth (a user gather's `modifier_rank`):
        store this rank's chunk and rebuild the secondary copy. Returns the chunk of `full`."""
        chunk = full[slice(*self._plan.layouts[u].partition(self._rank))]
        self.before_write()
        self.home.tensor[slice(*self._plan.shard_range(u))].copy_(chunk)
        self.refresh([u])
        return chunk

    def refresh(self, units: Iterable[int] | None = None) -> None:
        """The shards of `units` (default all) changed: rebuild what the gathers keep of them."""
        self._training.refresh(range(len(self._plan.buckets)) if units is None else units)

    def before_write(self) -> None:
        """Before the shards are written: no copy may still be reading them."""
        self._exact.synchronize()
        self._training.synchronize()

    def count_bytes(self, acc: BytesByHome, home_label: str, device: torch.device) -> None:
        acc.add(home_label, "params", self.home.tensor.numel() * self.home.tensor.element_size())
        extra = self._training.extra_bytes()
        if extra:  # the secondary partition (hpZ)
            acc.add(device.type, "params", extra)


class UnitState(Enum):
    RELEASED = "released"
    GATHERING = "gathering"
    GATHERED = "gathered"


class UnitBuffer:
    """One unit's padded flat buffer and its gather state. Its storage exists only while the
    unit is gathered (Note: [released storage] in zero/stage3.py)."""

    __slots__ = ("full", "state", "exact", "pinned", "user_pins", "_handle")

    def __init__(self, full: Tensor) -> None:
        self.full = full  # 1D, padded, parameter dtype
        self.state = UnitState.GATHERED
        self.exact = True
        """The gathered values are exact (Note: [exact gathers] in zero/stage3.py)."""
        self.pinned = False
        """Kept gathered until the step's backward is done (used outside its forward)."""
        self.user_pins = 0
        """Open `GatheredParameters` blocks holding this unit."""
        self._handle: "Handle | PendingGather | None" = None

    @property
    def released(self) -> bool:
        return self.state is UnitState.RELEASED

    @property
    def held(self) -> bool:
        """Pinned by a forward or by a user gather: not released."""
        return self.pinned or self.user_pins > 0

    def start(self, gather: UnitGather, u: int) -> None:
        """Allocate the storage and start gathering unit `u` along `gather`."""
        full = self.full
        full.untyped_storage().resize_(full.numel() * full.element_size())
        self._handle = gather.start(u, full)
        self.exact = gather.exact
        self.state = UnitState.GATHERING

    def finish(self) -> bool:
        """Wait for a started gather; True when there was one (the unit is now gathered)."""
        if self.state is not UnitState.GATHERING:
            return False
        self._wait()
        self.state = UnitState.GATHERED
        return True

    def _wait(self) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            raise AssertionError("expected a pending gather handle")
        handle.wait()

    def free(self, rebind: Callable[[Tensor], None] | None = None) -> None:
        """Release: the storage goes (after any gather in flight). With ``rebind`` the gathered
        storage is left to whoever still holds a view of it (it goes when they do): ``full``
        becomes a new buffer of the same size, ``rebind(full)`` points the unit's parameters at
        it (setting ``.data`` needs the storage), and then its storage goes."""
        if self.state is UnitState.GATHERING:
            self._wait()
        if rebind is not None:
            full = torch.empty(self.full.numel(), dtype=self.full.dtype, device=self.full.device)
            rebind(full)
            self.full = full
        self.full.untyped_storage().resize_(0)
        self.state = UnitState.RELEASED

    def invalidate(self) -> None:
        """The shards changed under a gathered unit: mark it released, storage kept, so the
        next gather fills it again."""
        if self.state is UnitState.GATHERING:
            self._wait()
        self.state = UnitState.RELEASED
