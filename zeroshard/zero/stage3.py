"""Stage 3: every parameter lives as a 1/N shard; units are gathered before use, released after.

Units (zero/units.py) are modules whose parameters are gathered together: by default each block
of a ModuleList plus the root. Each unit is one bucket of a `BucketedPartition`: its
parameters packed into one flat buffer split evenly over the ranks; the flat buffer's storage
exists only while the unit is gathered (Note: [released storage]). Small parameters
(`stage3_param_persistence_threshold`) form a persistent unit that stays gathered and is
all-gathered after each step, like stage 2.

Per micro-batch:
  forward pre-hook   gather the unit (waiting for its prefetch), prefetch the next units
  forward post-hook  release it, unless it is used again soon (zero/schedule.py); hook its
                     outputs so the unit is gathered again before its backward, prefetching
                     the units before it (backward runs the order in reverse)
  grad hooks         stage each gradient in the reducer's pooled block for the unit; when the
                     unit's last gradient arrives, reduce it into the gradient shard and release
The optimizer shard (zero/shard.py) and the gradient reducer (zero/reduce.py) are the ones
stages 1/2 use; this module keeps the units and their gather / release state machine.

Note: [recompute under activation checkpointing] torch.utils.checkpoint (and
zeroshard.checkpointing, HF's gradient_checkpointing_enable) runs a unit's forward a second
time during backward. That forward is recognised by running inside an autograd graph task
(`_in_recompute`): it gathers the unit again and prefetches the units before it, but it does
not record the execution order, start a micro-batch or prefetch forward, so the recorded
order that drives prefetch stays the order of the real forward. After it, the unit stays
gathered when its own backward is running (non-reentrant checkpoint) or comes next (it is the
last unit the recompute ran, or within `stage3_max_reuse_distance`); a unit the recompute ran
before another is released when the next one finishes and its recomputed outputs' hooks gather
it again for its backward, so a region spanning many units keeps about one gathered at a time.

Note: [exact gathers] with qwZ (`zero_quantized_weights`) the gathers that feed forward and
backward carry int8 codes (zero/gather.py); the master weights, optimizer state and the
low-precision shards stay exact. Three gathers stay exact: the persistent unit (parameters
below `stage3_param_persistence_threshold`: few bytes, and layer norms near 1 would lose the
most), user gathers (`GatheredParameters`: what a user reads, saves or modifies with
`modifier_rank` must be the true weights, or a save would store int8-rounded ones), and their
re-gather when a unit a user gathers is already gathered quantised. `_exact[u]` says which
kind a gathered unit holds.

Note: [released storage] a released unit's flat buffer keeps its tensor object but its storage
is resized to 0 bytes; parameters and any views autograd saved keep pointing at it and see the
data again after `resize_` + all-gather. Reading a released parameter raises (ZeroParameter).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from zeroshard.zero.flat import BucketedPartition
from zeroshard.comm.groups import node_rank_lists
from zeroshard.zero.gather import CopyStream, SecondaryPartition, quantized_all_gather
from zeroshard.zero.init_partition import gather_init_shards, init_partitioned
from zeroshard.zero.offload import OffloadPolicy
from zeroshard.zero.reduce import GradReducer, LaunchOrder, ReduceMode, ReduceOptions
from zeroshard.zero.schedule import ExecutionOrder, PrefetchPolicy
from zeroshard.zero.shard import OptimizerShard, ShardedStrategyBase
from zeroshard.zero.stage12 import ALIGN_NUMEL
from zeroshard.zero.strategy import BytesByHome, ModelStateBytes, ParamPiece
from zeroshard.zero.units import (
    ZeroParameter,
    ZeroParamState,
    assign_params,
    default_units,
    make_zero_parameter,
    tensors_in,
)

if TYPE_CHECKING:
    from zeroshard.comm import Comm, Handle
    from zeroshard.zero.gather import PendingGather
    from zeroshard.zero.nvme_params import MappedParamShard


@dataclass(frozen=True, slots=True)
class Stage3Options:
    grad_dtype: torch.dtype
    comm_dtype: torch.dtype | None
    persistence_threshold: int
    """Parameters with fewer elements stay whole on every rank."""
    prefetch_numel: int
    """Elements gathered ahead of use (`stage3_prefetch_bucket_size`)."""
    max_live_numel: int
    """Gathered elements at once, prefetch included (`stage3_max_live_parameters`)."""
    max_reuse_distance: int
    """Keep a unit gathered if it is used again within this many gathered elements."""
    prescale_factor: float = 1.0
    master_dtype: torch.dtype = torch.float32
    """dtype of the master shard (bf16 with `bf16.bf16_master_weights_and_grads`)."""
    overlap_comm: bool = True
    reduce_scatter: bool = True
    """Reduce-scatter each unit's gradients (False: all-reduce and keep this rank's chunk)."""
    offload_optimizer: OffloadPolicy = OffloadPolicy()
    """Where master shard, gradient shard and optimizer state live."""
    offload_param: OffloadPolicy = OffloadPolicy()
    """Where the low-precision parameter shards live between gathers."""
    quantized_gradients: bool = False
    """qgZ (`zero_quantized_gradients`): reduce each unit's gradients as int4 blocks
    (ReduceMode.QUANTIZED_REDUCE_SCATTER), whatever `reduce_scatter` says."""
    quantized_weights: bool = False
    """qwZ (`zero_quantized_weights`): the gathers of forward and backward carry int8 codes
    (zero/gather.py). Note: [exact gathers] says which gathers stay exact."""
    node_size: int = 1
    """Ranks per node (comm/groups.py `node_size`): qgZ reduces hierarchically (within the
    node, then across) when 1 < node_size < world size."""
    hpz_size: int = 1
    """hpZ (`zero_hpz_partition_size`): ranks per node holding a secondary partition that the
    gathers of forward and backward read (zero/gather.py, SecondaryPartition); 1 = off.
    zero/build.py checks it equals the node size and divides the world size."""


def _in_recompute() -> bool:
    """True inside a backward pass: a forward there is a checkpointed region's recompute."""
    return torch._C._current_graph_task_id() != -1


class UnitState(Enum):
    RELEASED = "released"
    GATHERING = "gathering"
    GATHERED = "gathered"


class Stage3Strategy(ShardedStrategyBase):
    """ZeRO stage 3 behind the `ZeroStrategy` protocol (zero/strategy.py); the owner
    (`ParamOwner`, `UserGatherable` in zero/units.py) of every parameter it partitions."""

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter], *, comm: "Comm", rank: int,
                 world_size: int, options: Stage3Options, units: Sequence[nn.Module] | None = None) -> None:
        self._comm, self._rank, self._world, self._opt = comm, rank, world_size, options
        self._prescale_factor = options.prescale_factor
        self._backward_started: set[int] = set()  # units whose outputs' gradients arrived
        self._recompute_tail: int | None = None  # the unit whose recompute finished last
        self._device = params[0].device if params else torch.device("cpu")
        trainable = {id(p) for p in params}
        self._init_units(module, list(units) if units is not None else default_units(module), trainable)
        self._init_shards()
        self._shard = OptimizerShard(self._plan, comm, self._params, trainable=self._trainable, lp=self._lp_shard,
                                     lp_is_flat=False, device=self._device, policy=options.offload_optimizer,
                                     lp_policy=options.offload_param, grad_dtype=options.grad_dtype,
                                     master_dtype=options.master_dtype)
        self._init_reduction()
        self._exec = ExecutionOrder()
        self._prefetch = PrefetchPolicy(self._exec, [f.numel() for f in self._full],
                                        prefetch_numel=options.prefetch_numel, max_live_numel=options.max_live_numel,
                                        max_reuse_distance=options.max_reuse_distance)
        self._install_hooks()
        self.peak_live_numel = 0
        self._training = False
        self._in_forward = False

    # -- construction ---------------------------------------------------------------------

    def _init_units(self, module: nn.Module, units: list[nn.Module], trainable: set[int]) -> None:
        assigned = assign_params(module, units)
        persistent: list[tuple[str, nn.Parameter]] = []
        groups: list[list[tuple[str, nn.Parameter]]] = []
        self._unit_modules: list[nn.Module | None] = []
        for i, unit in enumerate(units):
            keep = [(n, p) for n, p in assigned[i] if p.numel() >= self._opt.persistence_threshold]
            persistent += [(n, p) for n, p in assigned[i] if p.numel() < self._opt.persistence_threshold]
            groups.append(keep)
            self._unit_modules.append(unit)
        groups.append(persistent)          # the last unit: persistent, never released
        self._unit_modules.append(None)
        self._persistent = len(groups) - 1
        self._params = [p for g in groups for _, p in g]
        self._names = [n for g in groups for n, _ in g]
        self._trainable = [id(p) in trainable for p in self._params]
        bounds, start = [], 0
        for g in groups:
            bounds.append((start, start + len(g)))
            start += len(g)
        self._plan = BucketedPartition([p.numel() for p in self._params], world_size=self._world,
                                       align=ALIGN_NUMEL, buckets=bounds)
        self._unit_of = [u for u, (a, b) in enumerate(bounds) for _ in range(a, b)]

    def _init_shards(self) -> None:
        """Partition the whole model the ranks hold now; keep only this rank's shards."""
        dtypes = {p.dtype for p in self._params}
        if len(dtypes) > 1:
            raise ValueError(f"ZeRO stage 3 needs one parameter dtype, found {sorted(map(str, dtypes))}")
        self._dtype = dtypes.pop() if dtypes else torch.float32
        plan = self._plan
        self._lp_home = self._nvme_param_home(plan.shard_numel)  # Note: [parameters on NVMe]
        self._lp_shard = (self._lp_home.tensor if self._lp_home is not None else
                          self._opt.offload_param.allocate(plan.shard_numel, self._dtype, self._device))  # 1D
        self._hpz: SecondaryPartition | None = None
        if self._opt.hpz_size > 1:
            padded = [0 if u == self._persistent else plan.layouts[u].padded_numel for u in range(len(plan.buckets))]
            self._hpz = SecondaryPartition(*self._node_comms(self._opt.hpz_size), padded, dtype=self._dtype,
                                           device=self._device, quantized=self._opt.quantized_weights)
        self._pinned: set[int] = set()  # units kept gathered: used outside their unit's forward
        self._user_pins: dict[int, int] = {}
        self._full: list[Tensor] = []   # per unit, 1D padded flat buffer (storage may be empty)
        self._state: list[UnitState] = []
        self._handles: dict[int, "Handle | PendingGather"] = {}
        self._exact: list[bool] = []  # per unit: gathered values are exact (Note: [exact gathers])
        # Note: [copy stream] (zero/gather.py): host shards reach a GPU on a side stream.
        self._copies = (CopyStream(self._device)
                        if self._device.type == "cuda" and self._lp_shard.device.type == "cpu" else None)
        for u in range(len(plan.buckets)):
            full = torch.zeros(plan.layouts[u].padded_numel, dtype=self._dtype, device=self._device)
            first, last = plan.buckets[u]
            with torch.no_grad():
                for i in range(first, last):
                    p = self._params[i]
                    off = plan.param_flat_offsets[i] - plan.flat_offsets[u]
                    view = full[off : off + p.numel()].view(p.shape)
                    view.copy_(gather_init_shards(self._comm, p, self._world).view(p.shape)
                               if init_partitioned(p) else p.detach())  # zero.Init: only shards exist
                    p.data = view
                    make_zero_parameter(p, ZeroParamState(name=self._names[i], owner=self, unit=u))
                self._lp_shard[slice(*plan.shard_range(u))].copy_(full[slice(*plan.layouts[u].partition(self._rank))])
                if self._hpz is not None and u != self._persistent:
                    self._hpz.fill_from_full(u, full)
            self._full.append(full)
            self._state.append(UnitState.GATHERED)
            self._exact.append(True)
        for u in range(len(plan.buckets)):
            if u != self._persistent:
                self._release(u)
        if self._lp_home is not None:
            self._lp_home.evict_all()  # filled: on disk until the first forward reads it

    def _node_comms(self, size: int) -> tuple["Comm", "Comm"]:
        """Comms over this rank's node group and cross group (one rank per node)."""
        nodes, cross = node_rank_lists(self._world, size)
        return self._comm.split(nodes, "node"), self._comm.split(cross, "cross")

    def _init_reduction(self) -> None:
        opt = self._opt
        node = opt.node_size
        hierarchy = None
        if opt.quantized_gradients and 1 < node < self._world and self._world % node == 0:
            hierarchy = self._node_comms(node)  # Note: [hierarchical qgZ] in zero/reduce.py
        mode = ReduceMode.REDUCE_SCATTER if opt.reduce_scatter else ReduceMode.ALL_REDUCE_KEEP_CHUNK
        if opt.quantized_gradients:
            mode = ReduceMode.QUANTIZED_REDUCE_SCATTER
        self._reducer = GradReducer(self._comm, ReduceOptions(
            mode=mode, grad_dtype=opt.grad_dtype, comm_dtype=opt.comm_dtype,
            prescale_factor=opt.prescale_factor, overlap_comm=opt.overlap_comm),
            device=self._device, hierarchy=hierarchy)
        counts = [sum(self._trainable[a:b]) for a, b in self._plan.buckets]
        self._arrivals = LaunchOrder(self._unit_of, counts, in_order=False)

    def _install_hooks(self) -> None:
        for u, module in enumerate(self._unit_modules):
            if module is None:
                continue
            module.register_forward_pre_hook(lambda m, a, u=u: self._pre_forward(u))
            module.register_forward_hook(lambda m, a, out, u=u: self._post_forward(u, out))
        for i, p in enumerate(self._params):
            if self._trainable[i]:
                p.register_post_accumulate_grad_hook(lambda t, i=i: self._on_grad_ready(i, t))

    def __repr__(self) -> str:
        first, last = self._plan.buckets[self._persistent]
        return (f"Stage3Strategy({len(self._params)} params in {len(self._plan.buckets) - 1} units + "
                f"{last - first} persistent params, shard {self._plan.shard_numel} elements on rank "
                f"{self._rank}, params on {self._lp_shard.device}, {self._shard!r})")

    @property
    def _order(self) -> list[int]:
        """The recorded unit order (zero/schedule.py)."""
        return self._exec.order

    # -- gather / release -----------------------------------------------------------------

    def _live_numel(self) -> int:
        return sum(self._full[u].numel() for u, s in enumerate(self._state) if s is not UnitState.RELEASED)

    def _nvme_param_home(self, numel: int) -> "MappedParamShard | None":
        """With `offload_param.device: "nvme"`, the swap file the shard lives in (the directory
        is checked now, before any step)."""
        home = self._opt.offload_param.nvme
        if home is None:
            return None
        from zeroshard.zero.nvme_io import check_swap_dir
        from zeroshard.zero.nvme_params import MappedParamShard

        nbytes = numel * torch.empty((), dtype=self._dtype).element_size()
        root = check_swap_dir(home.path, nbytes, key=home.key, direct=None)
        return MappedParamShard(root, numel, self._dtype, rank=self._rank, max_in_cpu=home.max_in_cpu)

    def _host_chunk(self, u: int) -> Tensor:
        """This rank's chunk of unit `u` where the shard lives (low precision)."""
        start, end = self._plan.shard_range(u)
        if self._lp_home is not None:
            self._lp_home.use(start, end)  # read ahead; keep at most max_in_cpu elements mapped in
        return self._lp_shard[start:end]

    def _primary(self, u: int) -> Tensor:
        """This rank's chunk of unit `u` (low precision, on the device)."""
        return self._host_chunk(u).to(self._device, non_blocking=True)

    def _start_gather(self, u: int, exact: bool = False) -> None:
        """Start gathering unit `u`: from the node's secondary partition under hpZ, int8 codes
        under qwZ, unless `exact` or persistent (Note: [exact gathers])."""
        if self._state[u] is not UnitState.RELEASED:
            return
        full = self._full[u]
        full.untyped_storage().resize_(full.numel() * full.element_size())
        primary = exact or u == self._persistent or not (self._opt.quantized_weights or self._hpz is not None)
        if primary and self._copies is not None:
            self._handles[u] = self._copies.gather(self._comm, full, self._host_chunk(u))
        elif primary:
            self._handles[u] = self._comm.all_gather(full, self._primary(u), async_op=True)
        elif self._hpz is not None:
            self._handles[u] = self._hpz.gather(u, full)
        else:
            self._handles[u] = quantized_all_gather(self._comm, full, self._primary(u))
        self._exact[u] = primary or not self._opt.quantized_weights
        self._state[u] = UnitState.GATHERING
        if self._training:  # the training working set; user gathers are the user's choice
            self.peak_live_numel = max(self.peak_live_numel, self._live_numel())

    def _sync_copies(self) -> None:
        """Before the host shards are written: no copy may still be reading them."""
        if self._copies is not None:
            self._copies.synchronize()

    def _gather(self, u: int, exact: bool = False) -> None:
        if exact and self._state[u] is not UnitState.RELEASED and not self._exact[u]:
            self._regather(u, exact=True)
            return
        self._start_gather(u, exact)
        if self._state[u] is UnitState.GATHERING:
            self._handles.pop(u).wait()
            self._state[u] = UnitState.GATHERED
            self._set_gathered(u, True)

    def _release(self, u: int) -> None:
        if (u == self._persistent or self._state[u] is UnitState.RELEASED or u in self._pinned
                or self._user_pins.get(u, 0) > 0):
            return
        if self._state[u] is UnitState.GATHERING:
            self._handles.pop(u).wait()
        self._full[u].untyped_storage().resize_(0)
        self._state[u] = UnitState.RELEASED
        self._set_gathered(u, False)

    def _is_released(self, u: int) -> bool:
        return self._state[u] is UnitState.RELEASED

    def _set_gathered(self, u: int, gathered: bool) -> None:
        first, last = self._plan.buckets[u]
        for p in self._params[first:last]:
            p._zs.gathered = gathered  # type: ignore[attr-defined]

    def on_demand(self, params: list[ZeroParameter]) -> bool:
        """Parameters used outside their unit's forward during a forward: gather their units and
        keep them until the step's backward is done (saved views need them)."""
        if not (self._training or self._in_forward):
            return False
        for unit in sorted({p._zs.unit for p in params}):
            self._pinned.add(unit)
            self._gather(unit)
        return True

    def _regather(self, u: int, exact: bool) -> None:
        """Gather a gathered unit again (its storage stays allocated)."""
        if self._state[u] is UnitState.GATHERING:
            self._handles.pop(u).wait()
        self._state[u] = UnitState.RELEASED
        self._gather(u, exact)

    def _refresh_gathered(self) -> None:
        """The shards changed: rebuild the hpZ secondary partition, then the units gathered now
        (the persistent one, pinned ones) re-read their shards, each the kind of gather it held."""
        self._refresh_secondary()
        for u, state in enumerate(self._state):
            if state is not UnitState.RELEASED:
                self._regather(u, self._exact[u])

    def _refresh_secondary(self, units: Sequence[int] | None = None) -> None:
        """hpZ: rebuild the secondary chunks of `units` (default all) from the primary shards;
        the only gathers of a training step that cross nodes (Note in zero/gather.py)."""
        if self._hpz is None:
            return
        pending = [self._hpz.refresh(u, self._primary(u))
                   for u in (range(len(self._full)) if units is None else units) if u != self._persistent]
        for handle in pending:
            handle.wait()

    # -- hooks ----------------------------------------------------------------------------

    def _pre_forward(self, u: int) -> None:
        if _in_recompute():  # Note: [recompute under activation checkpointing]
            self._gather(u)
            self._prefetch.prefetch_backward(u, self._live_numel, self._is_released, self._start_gather)
            return
        if u == 0:  # the root: a new forward (and, when training, a new micro-batch)
            self._in_forward = True
            self._training = torch.is_grad_enabled()
            if self._training:
                self._arrivals.reset()
                self._backward_started = set()  # units whose outputs' gradients arrived
                self._recompute_tail = None  # the unit whose recompute finished last
                self._reducer.end_micro_batch()
                self._exec.start_forward()
        if self._training:
            self._exec.record(u)
        self._gather(u)
        self._prefetch.prefetch_forward(self._live_numel, self._start_gather)

    def _post_forward(self, u: int, output: Any) -> Any:
        outs = [t for t in tensors_in(output) if t.requires_grad]
        if outs and torch.is_grad_enabled():
            fired = [False]

            def pre_backward(grad: Tensor, u: int = u) -> None:
                if not fired[0]:
                    fired[0] = True
                    self._backward_started.add(u)
                    self._gather(u)
                    self._prefetch.prefetch_backward(u, self._live_numel, self._is_released, self._start_gather)

            for t in outs:
                t.register_hook(pre_backward)
        if _in_recompute():  # Note: [recompute under activation checkpointing]
            # The region's last unit is the first whose backward runs: keep it. The one kept
            # before it is not last after all; release it unless its backward is running.
            prev, self._recompute_tail = self._recompute_tail, u
            if (prev is not None and prev != u and prev not in self._backward_started
                    and self._full[prev].numel() > self._opt.max_reuse_distance):
                self._release(prev)
            return None
        if not (torch.is_grad_enabled() and self._prefetch.reused_soon(u)):
            self._release(u)
        if u == 0:
            self._in_forward = False
        if u == 0 and not self._training:  # evaluation: nothing outlives the forward
            self._pinned.clear()
            for v in range(len(self._plan.buckets)):
                self._release(v)
        return None

    def _on_grad_ready(self, index: int, param: Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        u = self._unit_of[index]
        off = self._plan.param_flat_offsets[index] - self._plan.flat_offsets[u]
        self._reducer.accumulate(u, self._full[u].numel(), off, grad, first=not self._arrivals.seen(index))
        param.grad = None
        for ready in self._arrivals.arrive(index):
            if ready != self._persistent:
                self._reduce(ready)
                self._release(ready)

    def _reduce(self, u: int) -> None:
        self._arrivals.mark_launched(u)
        data = self._reducer.staging(u, self._full[u].numel())  # zeros if no gradient arrived
        self._reducer.launch(u, data, self._shard.grad_target(u))

    # -- ZeroStrategy ---------------------------------------------------------------------

    def begin_micro_batch(self, boundary: bool) -> None:
        """Nothing to do: the root unit's forward pre-hook starts each micro-batch."""

    def after_backward(self) -> None:
        # Units whose gradients all arrived were reduced during backward, in backward order
        # (the same on every rank); the rest (persistent, partly unused) follow in index order.
        for u in self._arrivals.remaining():
            first, last = self._plan.buckets[u]
            if any(self._trainable[first:last]):
                self._reduce(u)
        self._reducer.drain()
        self._pinned.clear()
        for u in range(len(self._plan.buckets)):
            self._release(u)
        self._exec.finish_recording()
        self._training = False

    def after_step(self, applied: bool) -> None:
        self._shard.after_step()
        self._reducer.end_step()
        if not applied:
            return
        self._sync_copies()
        self._shard.store_master_to_lp()
        self._refresh_secondary()
        if self._lp_home is not None:
            self._lp_home.evict_all()  # the step wrote every shard: back to disk until next used
        # The persistent unit stays gathered: refresh it now. Other units gather on next use.
        self._regather(self._persistent, exact=True)

    def model_state_bytes(self, optimizer_state_bytes: int) -> list[ModelStateBytes]:
        acc = BytesByHome()
        persistent = self._full[self._persistent]
        acc.add(self._device.type, "params", persistent.numel() * persistent.element_size())  # whole everywhere
        acc.add(self._opt.offload_param.label(self._device), "params",
                self._lp_shard.numel() * self._lp_shard.element_size())
        if self._hpz is not None:  # the secondary partition (hpZ)
            acc.add(self._device.type, "params", self._hpz.shard.numel() * self._hpz.shard.element_size())
        self._shard.count_bytes(acc, optimizer_state_bytes)
        return acc.result()

    def transient_bytes(self) -> int:
        """Bytes kept for reuse beyond the model states: the reducer's staging pool."""
        return self._reducer.pool_bytes()

    # -- user gathers (zero.GatheredParameters) --------------------------------------------

    def gather_params(self, params: Sequence[ZeroParameter]) -> None:
        """Gather the units of `params` for the user until `release_params`; collective."""
        for u in sorted({p._zs.unit for p in params}):  # every rank gathers in the same order
            self._user_pins[u] = self._user_pins.get(u, 0) + 1
            self._gather(u, exact=True)  # Note: [exact gathers]

    def release_params(self, params: Sequence[ZeroParameter], modifier_rank: int | None) -> None:
        """End a user gather; with `modifier_rank`, that rank's whole values become the truth."""
        for u in sorted({p._zs.unit for p in params}):
            if modifier_rank is not None:
                full = self._full[u]
                self._comm.broadcast(full, src=modifier_rank)
                chunk = full[slice(*self._plan.layouts[u].partition(self._rank))]
                self._sync_copies()
                self._lp_shard[slice(*self._plan.shard_range(u))].copy_(chunk)
                master = self._shard.master_chunk(u)
                if master is not None:
                    master.copy_(chunk)
                self._refresh_secondary([u])
            self._user_pins[u] -= 1
            if self._user_pins[u] == 0:
                del self._user_pins[u]
                self._release(u)

    # -- pipelines (runtime/pipe_engine.py) ----------------------------------------------------

    def hold_for_batch(self) -> None:
        """Gather every unit and keep it until `release_batch`: a pipeline stage runs its layers
        outside the root module's forward (no unit hook fires), and keeping the units gathered
        across a batch's micro-batches is the point (one gather per batch, torchtitan's choice)."""
        self.gather_params(self._params)

    def release_batch(self) -> None:
        self.release_params(self._params, None)

    def begin_delivered_backward(self) -> None:
        """The batch's gradients arrive in one backward no root forward started (Note: [pipeline
        gradient capture] in pipe/schedule.py): start the arrivals and the reducer afresh."""
        self._arrivals.reset()
        self._backward_started = set()
        self._reducer.end_micro_batch()
        self._training = True

    def unit_of(self, param: ZeroParameter) -> int:
        return param._zs.unit

    # -- DeepSpeed's ds_* attributes (ZeroParameter's properties read these) ---------------

    def param_index(self, param: nn.Parameter) -> int:
        index = getattr(self, "_index_of", None)
        if index is None:
            index = self._index_of = {id(p): i for i, p in enumerate(self._params)}
        if id(param) not in index:
            raise AssertionError(f"expected {param._zs.name if isinstance(param, ZeroParameter) else '?'} "
                                 "to be managed by this strategy")
        return index[id(param)]

    def local_shard(self, param: nn.Parameter) -> Tensor:
        """A view of this rank's piece of `param` in the low-precision shard (1-D; may be empty)."""
        index = self.param_index(param)
        for f in self._plan.rank_fragments(self._rank):
            if f.param_index == index:
                return self._lp_shard[f.shard_offset : f.shard_offset + f.numel]
        return self._lp_shard[:0]

    def is_persistent(self, param: ZeroParameter) -> bool:
        return self.unit_of(param) == self._persistent

    # -- checkpoints (Note: [checkpoint fragments] in runtime/checkpointing.py) -------------

    def param_pieces(self) -> list[ParamPiece] | None:
        """This rank's low-precision pieces of every parameter (frozen ones included)."""
        return [ParamPiece(param=self._params[f.param_index], param_offset=f.param_offset, numel=f.numel,
                           data=self._lp_shard[f.shard_offset : f.shard_offset + f.numel])
                for f in self._plan.rank_fragments(self._rank)]

    @torch.no_grad()
    def sync_params_from_master(self) -> None:
        self._sync_copies()
        self._shard.store_master_to_lp()
        self._refresh_gathered()

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        self._shard.load_master_from_lp()
        self._refresh_gathered()
