"""Stage 3: every parameter lives as a 1/N shard; units are gathered before use, released after.

Units (zero/units.py) are modules whose parameters are gathered together: by default each block
of a ModuleList plus the root. Each unit is one bucket of a `BucketedPartition`: its
parameters packed into one flat buffer split evenly over the ranks; the flat buffer's storage
exists only while the unit is gathered (Note: [released storage]). Small parameters
(`stage3_param_persistence_threshold`) form a persistent unit that stays gathered and is
all-gathered after each step, like stage 2.

Per micro-batch:
  forward pre-hook   gather the unit (waiting for its prefetch), prefetch the next units
  forward post-hook  release it, unless it is used again soon (`stage3_max_reuse_distance`);
                     hook its outputs so the unit is gathered again before its backward,
                     prefetching the units before it (backward runs the order in reverse)
  grad hooks         copy each gradient into the unit's staging buffer; when the unit's last
                     gradient arrives, reduce-scatter it into the gradient shard and release
The optimizer steps on fragments (views of the fp32 master shard), exactly as stages 1/2.

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
from zeroshard.zero.init_partition import gather_init_shards, init_partitioned
from zeroshard.zero.stage12 import ALIGN_NUMEL, MAX_BUCKETS_IN_FLIGHT
from zeroshard.zero.strategy import (
    GradStats,
    MasterFragment,
    ModelStateBytes,
    ParamPiece,
    attach_grads,
    sum_of_squares,
    unscale_and_clip,
)
from zeroshard.zero.units import ZeroParameter, assign_params, default_units, tensors_in

if TYPE_CHECKING:
    from zeroshard.comm import Comm, Handle


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
    overlap_comm: bool = True
    optimizer_home: torch.device | None = None
    """`offload_optimizer`: where master shard, gradient shard and optimizer state live."""
    param_home: torch.device | None = None
    """`offload_param`: where the low-precision parameter shards live between gathers."""


def _in_recompute() -> bool:
    """True inside a backward pass: a forward there is a checkpointed region's recompute."""
    return torch._C._current_graph_task_id() != -1


class UnitState(Enum):
    RELEASED = "released"
    GATHERING = "gathering"
    GATHERED = "gathered"


class Stage3Strategy:
    """ZeRO stage 3 behind the `ZeroStrategy` protocol (zero/strategy.py)."""

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter], *, comm: "Comm", rank: int,
                 world_size: int, options: Stage3Options, units: Sequence[nn.Module] | None = None) -> None:
        self._comm, self._rank, self._world, self._opt = comm, rank, world_size, options
        self._device = params[0].device if params else torch.device("cpu")
        trainable = {id(p) for p in params}
        self._init_units(module, list(units) if units is not None else default_units(module), trainable)
        self._init_shards()
        self._init_fragments()
        self._install_hooks()
        self.peak_live_numel = 0
        self._order: list[int] = []       # unit forward order recorded on the first step
        self._order_pos = 0
        self._recording = True
        self._training = False
        self._in_forward = False
        self._step_reset()
        self._micro_reset()

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
        self._module_unit = {id(m): i for i, m in enumerate(units)}

    def _init_shards(self) -> None:
        """Partition the whole model the ranks hold now; keep only this rank's shards."""
        dtypes = {p.dtype for p in self._params}
        if len(dtypes) > 1:
            raise ValueError(f"ZeRO stage 3 needs one parameter dtype, found {sorted(map(str, dtypes))}")
        self._dtype = dtypes.pop() if dtypes else torch.float32
        opt, plan = self._opt, self._plan
        self._param_home = opt.param_home or self._device
        self._home = opt.optimizer_home or self._device
        self._lp_shard = torch.zeros(plan.shard_numel, dtype=self._dtype, device=self._param_home)  # 1D
        self._pinned: set[int] = set()  # units kept gathered: used outside their unit, or by the user
        self._user_pins: dict[int, int] = {}
        self._full: list[Tensor] = []   # per unit, 1D padded flat buffer (storage may be empty)
        self._state: list[UnitState] = []
        for u in range(len(plan.buckets)):
            full = torch.zeros(plan.layouts[u].padded_numel, dtype=self._dtype, device=self._device)
            first, last = plan.buckets[u]
            with torch.no_grad():
                for i in range(first, last):
                    p = self._params[i]
                    off = plan.param_flat_offsets[i] - plan.flat_offsets[u]
                    view = full[off : off + p.numel()].view(p.shape)
                    if init_partitioned(p):  # built under zero.Init: only shards exist
                        view.view(-1).copy_(gather_init_shards(self._comm, p, self._world))
                        del p._zs_init_shard
                    else:
                        view.copy_(p.detach())
                    p.data = view
                self._lp_shard[slice(*plan.shard_range(u))].copy_(full[slice(*plan.layouts[u].partition(self._rank))])
            self._full.append(full)
            self._state.append(UnitState.GATHERED)
        for i, p in enumerate(self._params):
            p.__class__ = ZeroParameter
            p._zs_name, p._zs_unit, p._zs_gathered = self._names[i], self._unit_of[i], True
            p._zs_on_demand, p._zs_strategy = self._on_demand, self
        self._separate_master = self._dtype != torch.float32 or opt.optimizer_home is not None or opt.param_home is not None
        self._master = self._lp_shard
        if self._separate_master:
            self._master = self._lp_shard.to(self._home, torch.float32, copy=True)
        self._grad_shard = torch.zeros(plan.shard_numel, dtype=opt.grad_dtype, device=self._home)
        self._handles: dict[int, "Handle"] = {}
        for u in range(len(plan.buckets)):
            if u != self._persistent:
                self._release(u)

    def _init_fragments(self) -> None:
        self._fragment_params: list[nn.Parameter] = []
        self._fragment_grads: list[Tensor] = []
        self._master_of: dict[int, nn.Parameter] = {}
        for f in self._plan.rank_fragments(self._rank):
            if not self._trainable[f.param_index]:
                continue
            frag = nn.Parameter(self._master[f.shard_offset : f.shard_offset + f.numel])
            self._fragment_params.append(frag)
            self._fragment_grads.append(self._grad_shard[f.shard_offset : f.shard_offset + f.numel])
            self._master_of[id(self._params[f.param_index])] = frag

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
        return (f"Stage3Strategy({len(self._params)} params in {len(self._plan.buckets) - 1} units + "
                f"{self._plan.buckets[self._persistent][1] - self._plan.buckets[self._persistent][0]} "
                f"persistent params, shard {self._plan.shard_numel} elements on rank {self._rank}, "
                f"params on {self._param_home}, master on {self._home})")

    # -- gather / release -----------------------------------------------------------------

    def _live_numel(self) -> int:
        return sum(self._full[u].numel() for u, s in enumerate(self._state) if s is not UnitState.RELEASED)

    def _start_gather(self, u: int) -> None:
        if self._state[u] is not UnitState.RELEASED:
            return
        full = self._full[u]
        full.untyped_storage().resize_(full.numel() * full.element_size())
        mine = self._lp_shard[slice(*self._plan.shard_range(u))].to(self._device, non_blocking=True)
        self._handles[u] = self._comm.all_gather(full, mine, async_op=True)
        self._state[u] = UnitState.GATHERING
        if self._training:  # the training working set; user gathers are the user's choice
            self.peak_live_numel = max(self.peak_live_numel, self._live_numel())

    def _gather(self, u: int) -> None:
        self._start_gather(u)
        if self._state[u] is UnitState.GATHERING:
            self._handles.pop(u).wait()
            self._state[u] = UnitState.GATHERED
            self._set_gathered_flag(u, True)

    def _release(self, u: int) -> None:
        if (u == self._persistent or self._state[u] is UnitState.RELEASED or u in self._pinned
                or self._user_pins.get(u, 0) > 0):
            return
        if self._state[u] is UnitState.GATHERING:
            self._handles.pop(u).wait()
        self._full[u].untyped_storage().resize_(0)
        self._state[u] = UnitState.RELEASED
        self._set_gathered_flag(u, False)

    def _set_gathered_flag(self, u: int, gathered: bool) -> None:
        first, last = self._plan.buckets[u]
        for p in self._params[first:last]:
            p._zs_gathered = gathered

    def _on_demand(self, params: list[ZeroParameter]) -> bool:
        """Parameters used outside their unit's forward during a forward: gather their units and
        keep them until the step's backward is done (saved views need them)."""
        if not (self._training or self._in_forward):
            return False
        for unit in sorted({p._zs_unit for p in params}):
            self._pinned.add(unit)
            self._gather(unit)
        return True

    # -- hooks ----------------------------------------------------------------------------

    def _pre_forward(self, u: int) -> None:
        if _in_recompute():  # Note: [recompute under activation checkpointing]
            self._gather(u)
            self._prefetch_before(u)
            return
        if u == 0:  # the root: a new forward (and, when training, a new micro-batch)
            self._in_forward = True
            self._training = torch.is_grad_enabled()
            if self._training:
                self._micro_reset()
                self._order_pos = 0
        if self._training:
            self._record(u)
        self._gather(u)
        self._prefetch_after(u)

    def _record(self, u: int) -> None:
        if self._recording:
            self._order.append(u)
        elif self._order_pos >= len(self._order) or self._order[self._order_pos] != u:
            self._order, self._recording = self._order[: self._order_pos] + [u], True  # order changed
        self._order_pos += 1

    def _prefetch_after(self, u: int) -> None:
        if self._recording or not self._order:
            return
        budget = self._opt.prefetch_numel
        for nxt in self._order[self._order_pos :]:
            need = self._full[nxt].numel()
            if budget < need or self._live_numel() + need > self._opt.max_live_numel:
                break
            self._start_gather(nxt)
            budget -= need

    def _prefetch_before(self, u: int) -> None:
        """Backward runs the recorded forward order in reverse: gather the units before `u`."""
        if self._recording or u not in self._order:
            return
        position = len(self._order) - 1 - self._order[::-1].index(u)
        budget = self._opt.prefetch_numel
        for prev in reversed(self._order[:position]):
            need = self._full[prev].numel()
            if self._state[prev] is not UnitState.RELEASED:
                # Already gathered or in flight: it is part of what is ahead of use. (Without
                # counting it, a second call for the same unit, as the recompute of activation
                # checkpointing makes, prefetched one unit further each time.)
                budget -= need
                continue
            if budget < need or self._live_numel() + need > self._opt.max_live_numel:
                break
            self._start_gather(prev)
            budget -= need

    def _post_forward(self, u: int, output: Any) -> Any:
        outs = [t for t in tensors_in(output) if t.requires_grad]
        if outs and torch.is_grad_enabled():
            fired = [False]

            def pre_backward(grad: Tensor, u: int = u) -> None:
                if not fired[0]:
                    fired[0] = True
                    self._backward_started.add(u)
                    self._gather(u)
                    self._prefetch_before(u)

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
        if not self._reused_soon(u):
            self._release(u)
        if u == 0:
            self._in_forward = False
        if u == 0 and not self._training:  # evaluation: nothing outlives the forward
            self._pinned.clear()
            for v in range(len(self._plan.buckets)):
                self._release(v)
        return None

    def _reused_soon(self, u: int) -> bool:
        """True if `u` comes back within max_reuse_distance gathered elements (the last units
        of forward are the first of backward)."""
        if self._recording or not torch.is_grad_enabled():
            return False
        upcoming = self._order[self._order_pos :]
        if not upcoming:
            return self._full[u].numel() <= self._opt.max_reuse_distance
        distance = 0
        for nxt in upcoming:
            if nxt == u:
                return True
            distance += self._full[nxt].numel()
            if distance > self._opt.max_reuse_distance:
                return False
        return False

    def _on_grad_ready(self, index: int, param: Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        u = self._unit_of[index]
        staging = self._staging.get(u)
        if staging is None:
            staging = self._staging[u] = torch.zeros(self._full[u].numel(), dtype=self._opt.grad_dtype,
                                                     device=self._device)
        off = self._plan.param_flat_offsets[index] - self._plan.flat_offsets[u]
        view = staging[off : off + param.numel()]
        view.add_(grad.reshape(-1)) if self._seen[index] else view.copy_(grad.reshape(-1))
        param.grad = None
        if not self._seen[index]:
            self._seen[index] = True
            self._pending[u] -= 1
            if self._pending[u] == 0 and u != self._persistent:
                self._reduce(u)
                self._release(u)

    # -- reduction ------------------------------------------------------------------------

    def _reduce(self, u: int) -> None:
        staging = self._staging.pop(u, None)
        if staging is None:
            staging = torch.zeros(self._full[u].numel(), dtype=self._opt.grad_dtype, device=self._device)
        if self._opt.prescale_factor != 1.0:
            staging.mul_(1.0 / self._opt.prescale_factor)
        recv = torch.empty(self._plan.layouts[u].partition_numel, dtype=staging.dtype, device=self._device)
        handle = self._comm.reduce_scatter(recv, staging, async_op=True, comm_dtype=self._opt.comm_dtype)
        self._in_flight.append((u, handle, staging, recv))
        self._reduced.add(u)
        limit = MAX_BUCKETS_IN_FLIGHT if self._opt.overlap_comm else 0
        while len(self._in_flight) > limit:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        u, handle, _, recv = self._in_flight.pop(0)
        handle.wait()
        target = self._grad_shard[slice(*self._plan.shard_range(u))]
        if self._folded[u]:
            target.add_(recv.to(target.device, non_blocking=True))
        else:
            target.copy_(recv, non_blocking=True)
            self._folded[u] = True

    # -- ZeroStrategy ---------------------------------------------------------------------

    @property
    def optimizer_params(self) -> list[nn.Parameter]:
        return list(self._fragment_params)

    def master_params_for(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        known = {id(p) for p in self._params}
        out = []
        for p in params:
            if id(p) not in known:
                raise ValueError("the optimizer was given a parameter that is not a parameter of the "
                                 "model passed to initialize()")
            if id(p) in self._master_of:
                out.append(self._master_of[id(p)])
        return out

    def _step_reset(self) -> None:
        self._folded = [False] * len(self._plan.buckets)

    def _micro_reset(self) -> None:
        self._pending = [sum(self._trainable[a:b]) for a, b in self._plan.buckets]
        self._seen = [False] * len(self._params)
        self._staging: dict[int, Tensor] = {}
        self._in_flight: list[tuple[int, "Handle", Tensor, Tensor]] = []
        self._reduced: set[int] = set()
        self._backward_started: set[int] = set()  # units whose outputs' gradients arrived
        self._recompute_tail: int | None = None  # the unit whose recompute finished last

    def begin_micro_batch(self, boundary: bool) -> None:
        """Nothing to do: the root unit's forward pre-hook starts each micro-batch."""

    def after_backward(self) -> None:
        # Units whose gradients all arrived were reduced during backward, in backward order
        # (the same on every rank); the rest (persistent, partly unused) follow in index order.
        for u, (first, last) in enumerate(self._plan.buckets):
            if u not in self._reduced and any(self._trainable[first:last]):
                self._reduce(u)
        while self._in_flight:
            self._finish_oldest()
        self._pinned.clear()
        for u in range(len(self._plan.buckets)):
            self._release(u)
        if self._recording and self._order:
            self._recording = False
        self._training = False

    def prepare_step(self, grad_scale: float, max_norm: float) -> GradStats:
        sq = sum_of_squares([self._grad_shard]).to(self._device)
        self._comm.all_reduce(sq)
        mult = grad_scale * self._opt.prescale_factor / self._world
        stats = unscale_and_clip([self._grad_shard], sq.item(), mult, max_norm)
        if not stats.overflow:
            attach_grads(self._fragment_params, self._fragment_grads)
        return stats

    def after_step(self, applied: bool) -> None:
        for frag in self._fragment_params:
            frag.grad = None
        self._step_reset()
        if not applied:
            return
        if self._separate_master:
            self._lp_shard.copy_(self._master, non_blocking=True)
        # The persistent unit stays gathered: refresh it now. Other units gather on next use.
        p = self._persistent
        self._state[p] = UnitState.RELEASED
        self._gather(p)

    def model_state_bytes(self, optimizer_state_bytes: int) -> list[ModelStateBytes]:
        def nbytes(t: Tensor) -> int:
            return t.numel() * t.element_size()

        entries: dict[str, dict[str, int]] = {}

        def add(offloaded: bool, home: torch.device, key: str, value: int) -> None:
            name = f"{home.type} (offload)" if offloaded else self._device.type
            entry = entries.setdefault(name, dict.fromkeys(("params", "grads", "master_params", "optimizer_states"), 0))
            entry[key] += value

        opt_off, param_off = self._opt.optimizer_home is not None, self._opt.param_home is not None
        add(False, self._device, "params", nbytes(self._full[self._persistent]))  # whole on every rank
        add(param_off, self._param_home, "params", nbytes(self._lp_shard))
        add(opt_off, self._home, "grads", nbytes(self._grad_shard))
        add(opt_off, self._home, "master_params", nbytes(self._master) if self._separate_master else 0)
        add(opt_off, self._home, "optimizer_states", optimizer_state_bytes)
        return [ModelStateBytes(device=name, **v) for name, v in entries.items()]

    # -- user gathers (zero.GatheredParameters) --------------------------------------------

    def gather_units(self, units: Sequence[int]) -> None:
        """Gather `units` for the user until `release_units`; collective, in the given order."""
        for u in units:
            self._user_pins[u] = self._user_pins.get(u, 0) + 1
            self._gather(u)

    def release_units(self, units: Sequence[int], modifier_rank: int | None) -> None:
        """End a user gather; with `modifier_rank`, that rank's whole values become the truth."""
        for u in units:
            if modifier_rank is not None:
                full = self._full[u]
                self._comm.broadcast(full, src=modifier_rank)
                chunk = full[slice(*self._plan.layouts[u].partition(self._rank))]
                shard = slice(*self._plan.shard_range(u))
                self._lp_shard[shard].copy_(chunk)
                if self._separate_master:
                    self._master[shard].copy_(chunk)
            self._user_pins[u] -= 1
            if self._user_pins[u] == 0:
                del self._user_pins[u]
                self._release(u)

    def unit_of(self, param: nn.Parameter) -> int:
        return int(getattr(param, "_zs_unit"))

    # -- DeepSpeed's ds_* attributes (ZeroParameter's properties read these) ---------------

    def param_index(self, param: nn.Parameter) -> int:
        index = getattr(self, "_index_of", None)
        if index is None:
            index = self._index_of = {id(p): i for i, p in enumerate(self._params)}
        if id(param) not in index:
            raise AssertionError(f"expected {getattr(param, '_zs_name', '?')} to be managed by this strategy")
        return index[id(param)]

    def local_shard(self, param: nn.Parameter) -> Tensor:
        """A view of this rank's piece of `param` in the low-precision shard (1-D; may be empty)."""
        index = self.param_index(param)
        for f in self._plan.rank_fragments(self._rank):
            if f.param_index == index:
                return self._lp_shard[f.shard_offset : f.shard_offset + f.numel]
        return self._lp_shard[:0]

    def is_persistent(self, param: nn.Parameter) -> bool:
        return self.unit_of(param) == self._persistent

    # -- checkpoints (Note: [checkpoint fragments] in runtime/checkpointing.py) -------------

    def checkpoint_fragments(self) -> list[MasterFragment]:
        frags = [f for f in self._plan.rank_fragments(self._rank) if self._trainable[f.param_index]]
        return [MasterFragment(param=self._params[f.param_index], param_offset=f.param_offset, numel=f.numel,
                               master=m) for f, m in zip(frags, self._fragment_params)]

    def param_pieces(self) -> list[ParamPiece] | None:
        """This rank's low-precision pieces of every parameter (frozen ones included)."""
        return [ParamPiece(param=self._params[f.param_index], param_offset=f.param_offset, numel=f.numel,
                           data=self._lp_shard[f.shard_offset : f.shard_offset + f.numel])
                for f in self._plan.rank_fragments(self._rank)]

    def fragment_grads(self, grad_scale: float) -> list[Tensor]:
        mult = grad_scale * self._opt.prescale_factor / self._world
        return [g.float() * mult for g in self._fragment_grads]

    @torch.no_grad()
    def sync_params_from_master(self) -> None:
        if self._separate_master:
            self._lp_shard.copy_(self._master)
        self._regather()

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        if self._separate_master:
            self._master.copy_(self._lp_shard)
        self._regather()

    def _regather(self) -> None:
        """Units gathered now (the persistent one, pinned ones) re-read their shards."""
        for u, state in enumerate(self._state):
            if state is not UnitState.RELEASED:
                self._state[u] = UnitState.RELEASED
                self._gather(u)
