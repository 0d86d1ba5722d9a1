"""Stage 3: every parameter lives as a 1/N shard; units are gathered before use, released after.

Units (zero/units.py) are modules whose parameters are gathered together: by default each block
of a ModuleList plus the root. Each unit is one bucket of a `BucketedPartition`: its
parameters packed into one flat buffer split evenly over the ranks; the flat buffer's storage
exists only while the unit is gathered (Note: [released storage]). Small parameters
(`stage3_param_persistence_threshold`) form a persistent unit that stays gathered and is
all-gathered after each step, like stage 2. zero/unit_plan.py makes that plan, once.

Per micro-batch:
  forward pre-hook   gather the unit (waiting for its prefetch), prefetch the next units
  forward post-hook  release it, unless it is used again soon, in this forward or in backward,
                     within `stage3_max_reuse_distance` (zero/schedule.py); hook its
                     outputs so the unit is gathered again before its backward, prefetching
                     the units before it (backward runs the order in reverse)
  grad hooks         stage each gradient in the reducer's pooled block for the unit; when the
                     unit's last gradient arrives, reduce it into the gradient shard and release
The optimizer shard (zero/shard.py) and the gradient reducer (zero/reduce.py) are the ones
stages 1/2 use. Where the parameter shard lives and how a unit becomes full (CPU/NVMe home,
side-stream copies, hpZ, qwZ) is zero/unit_shards.py's; this module keeps the units, their
hooks and the gather / release state machine.

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
re-gather when a unit a user gathers is already gathered quantised. `UnitBuffer.exact` says
which kind a gathered unit holds; `UnitShards.gather_for` picks the route.

Frozen parameters hold their unit until backward has read them: zero/frozen_reads.py (Note:
[frozen parameters in backward]).

Note: [released storage] a released unit's flat buffer keeps its tensor object but its storage
is resized to 0 bytes; parameters and any views autograd saved keep pointing at it and see the
data again after `resize_` + all-gather. Reading a released parameter raises (ZeroParameter).
A user gather (`GatheredParameters`) ends differently: the gathered storage is handed to
whatever views of it the user kept (they keep their values; it is freed when they go), and the
unit's parameters move to a new empty buffer, as DeepSpeed's release replaces `param.data`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from zeroshard.zero.frozen_reads import FrozenReads
from zeroshard.zero.gather import SecondaryPartition
from zeroshard.zero.init_partition import init_partitioned, init_values
from zeroshard.zero.parameter_offload import ParameterOffload
from zeroshard.zero.reduce import GradReducer, LaunchOrder, ReduceMode, ReduceOptions
from zeroshard.zero.schedule import ExecutionOrder, PrefetchPolicy
from zeroshard.zero.shard import OptimizerShard, ShardedStrategyBase
from zeroshard.zero.stage3_options import Stage3Options
from zeroshard.zero.stage12 import ALIGN_NUMEL
from zeroshard.zero.strategy import BytesByHome, ModelParallelNorm, ModelStateBytes, ParamPiece
from zeroshard.zero.unit_plan import plan_units
from zeroshard.zero.unit_shards import InMemoryShard, UnitBuffer, UnitShards, open_shard_home
from zeroshard.zero.units import (
    ZeroParameter,
    ZeroParamState,
    assign_data,
    default_units,
    make_zero_parameter,
    tensors_in,
)

if TYPE_CHECKING:
    from zeroshard.comm import Comm
    from zeroshard.zero.unit_shards import ShardHome


def _in_recompute() -> bool:
    """True inside a backward pass: a forward there is a checkpointed region's recompute."""
    return torch._C._current_graph_task_id() != -1


class Pass(Enum):
    """Which pass the model is in, as the root unit's hooks and `after_backward` see it."""

    IDLE = "idle"
    FORWARD = "forward"
    """A training forward (grad enabled): records the order, pins units used outside it."""
    EVAL_FORWARD = "eval_forward"
    """A forward without grad: everything is released when it ends."""
    BACKWARD = "backward"
    """After a training forward, until `after_backward`."""


class Stage3Strategy(ShardedStrategyBase):
    """ZeRO stage 3 behind the `ZeroStrategy` protocol (zero/strategy.py); the owner
    (`ParamOwner`, `UserGatherable` in zero/units.py) of every parameter it partitions."""

    def __init__(self, module: nn.Module, params: Sequence[nn.Parameter], *, comm: "Comm",
                 options: Stage3Options, units: Sequence[nn.Module] | None = None,
                 norm_group: ModelParallelNorm | None = None, include: set[int] | None = None) -> None:
        self._comm, self._opt = comm, options
        self._backward_started: set[int] = set()  # units whose outputs' gradients arrived
        self._recompute_tail: int | None = None  # the unit whose recompute finished last
        self._device = params[0].device if params else torch.device("cpu")
        self._pass = Pass.IDLE
        trainable = {id(p) for p in params}
        names = self._init_units(module, list(units) if units is not None else default_units(module), trainable,
                                 include)
        self._init_shards(names)
        self._shard = OptimizerShard(self._plan, comm, self._params, trainable=self._trainable, lp=self._shards.shard,
                                     lp_is_flat=False, device=self._device, policy=options.offload_optimizer,
                                     lp_policy=options.offload_param, grad_dtype=options.grad_dtype,
                                     master_dtype=options.master_dtype, norm_group=norm_group,
                                     release_grads=options.release_grads)
        self._init_reduction()
        self._exec = ExecutionOrder()
        self._prefetch = PrefetchPolicy(self._exec, [unit.full.numel() for unit in self._units],
                                        prefetch_numel=options.prefetch_numel, max_live_numel=options.max_live_numel,
                                        max_reuse_distance=options.max_reuse_distance)
        self._install_hooks(module)
        self.peak_live_numel = 0

    @property
    def _prescale_factor(self) -> float:  # ShardedStrategyBase's
        return self._opt.prescale_factor

    # -- construction ---------------------------------------------------------------------

    def _init_units(self, module: nn.Module, units: list[nn.Module], trainable: set[int],
                    include: set[int] | None) -> list[str]:
        """Assign the parameters (`include`: only those) to units (the last one persistent) and plan
        the partition (zero/unit_plan.py); returns the parameters' names, in plan order."""
        plan = plan_units(module, units, trainable, world_size=self._comm.world_size, align=ALIGN_NUMEL,
                          persistence_threshold=self._opt.persistence_threshold,
                          persistence_budget=self._opt.persistence_budget, include=include)
        self._params, self._trainable, self._unit_of = plan.params, plan.trainable, plan.unit_of
        self._unit_modules: list[nn.Module | None] = plan.unit_modules
        self._plan, self._persistent = plan.partition, plan.persistent
        self._index_of = {id(p): i for i, p in enumerate(self._params)}
        return plan.names

    def _init_shards(self, names: list[str]) -> None:
        """Partition the whole model the ranks hold now; keep only this rank's shards."""
        dtypes = {p.dtype for p in self._params}
        if len(dtypes) > 1:
            raise ValueError(f"ZeRO stage 3 needs one parameter dtype, found {sorted(map(str, dtypes))}")
        dtype = dtypes.pop() if dtypes else torch.float32
        plan = self._plan
        home = open_shard_home(self._opt.offload_param, plan.shard_numel, dtype, self._device,
                               rank=self._comm.rank)  # Note: [parameters on NVMe]
        secondary = None
        if self._opt.hpz_size > 1:
            padded = [0 if u == self._persistent else plan.layouts[u].padded_numel for u in range(len(plan.buckets))]
            secondary = SecondaryPartition(*self._node_comms(self._opt.hpz_size), padded, dtype=dtype,
                                           device=self._device, quantized=self._opt.quantized_weights)
        self._shards = UnitShards(plan, self._comm, rank=self._comm.rank, home=home, device=self._device,
                                  persistent=self._persistent, quantized=self._opt.quantized_weights,
                                  secondary=secondary, float8=self._float8_weights())
        self._units: list[UnitBuffer] = []
        for u in range(len(plan.buckets)):
            full = torch.zeros(plan.layouts[u].padded_numel, dtype=dtype, device=self._device)
            with torch.no_grad():
                for i, view in self._param_views(u, full):
                    p = self._params[i]
                    view.copy_(init_values(p).view(p.shape)
                               if init_partitioned(p) else p.detach())  # zero.Init: only shards exist
                    assign_data(p, view)  # a zero.Init parameter is partitioned already
                    make_zero_parameter(p, ZeroParamState(name=names[i], owner=self, unit=u))
                self._shards.fill(u, full)
            self._units.append(UnitBuffer(full))
        for u in range(len(plan.buckets)):
            if u != self._persistent:
                self._release(u)
        home.evict_all()  # filled: an NVMe home is on disk until the first forward reads it

    def _float8_weights(self) -> tuple[list[list[tuple[int, int, int]]], list[nn.Parameter]] | None:
        """`fp8.float8_all_gather`: each unit's float8 weights (runtime/fp8.py marks them
        `zs_float8_weight`) as (start, end, index) in its flat buffer, and the weights; None when off.
        The persistent unit always gathers exactly, so its weights are left out."""
        if not self._opt.float8_gather:
            return None
        plan, segments, weights = self._plan, [], []
        for u, (first, last) in enumerate(plan.buckets):
            mine = []
            for i in range(first, last):
                p = self._params[i]
                if u != self._persistent and getattr(p, "zs_float8_weight", False):
                    off = plan.param_flat_offsets[i] - plan.flat_offsets[u]
                    mine.append((off, off + p.numel(), len(weights)))
                    weights.append(p)
            segments.append(mine)
        return segments, weights

    def _node_comms(self, size: int) -> tuple["Comm", "Comm"]:
        """Comms over this rank's node group and cross group (one rank per node)."""
        return self._comm.node_split(size)  # sub-groups of the dp axis (comm/topology.py)

    def _init_reduction(self) -> None:
        opt = self._opt
        node = opt.node_size
        hierarchy = None
        if opt.quantized_gradients and 1 < node < self._comm.world_size and self._comm.world_size % node == 0:
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
        # Note: [frozen parameters in backward]
        self._frozen_reads = FrozenReads(len(self._plan.buckets), self._release)

    def _install_hooks(self, module: nn.Module) -> None:
        for i, p in enumerate(self._params):
            if self._trainable[i]:
                p.register_post_accumulate_grad_hook(lambda t, i=i: self._on_grad_ready(i, t))
        self._offload = ParameterOffload(self, module, self.install_module_hooks(),
                                         persistent_parameters=self._params[slice(*self._plan.buckets[self._persistent])])

    def install_module_hooks(self) -> tuple[list[RemovableHandle], list[RemovableHandle]]:
        """Register the units' gather/release hooks and the frozen-read hooks; returns their handles
        (DeepSpeed's forward_hooks, backward_hooks), which `ParameterOffload` holds. The gradient
        hooks stay installed for the strategy's life, as DeepSpeed's reduce hooks do."""
        forward: list[RemovableHandle] = []
        for u, module in enumerate(self._unit_modules):
            if module is None:
                continue
            forward.append(module.register_forward_pre_hook(lambda m, a, u=u: self._pre_forward(u)))
            forward.append(module.register_forward_hook(lambda m, a, out, u=u: self._post_forward(u, out)))
        backward: list[RemovableHandle] = []
        if self._unit_modules[0] is not None:
            backward = self._frozen_reads.install(self._unit_modules[0], {
                id(p): self._unit_of[i] for i, p in enumerate(self._params)
                if not self._trainable[i] and self._unit_of[i] != self._persistent})
        return forward, backward

    def keep_hooks_eager(self) -> None:
        """Note: [hooks under torch.compile] the gather/release hooks rebind parameter storage,
        resize flat buffers and run collectives on the ZeRO group: Dynamo must not trace them. They
        run eagerly under `torch._dynamo.disable`, so a compiled model breaks its graph at each
        unit's pre- and post-forward hook (one graph per unit boundary; the count is logged by
        runtime/compile.py). FSDP2 does the same for its hooks (`_fsdp_state.py`,
        `disable_if_config_true`). The hooks registered as lambdas look these attributes up at call
        time, so re-registered hooks (ParameterOffload) keep them. Imports torch._dynamo, which only
        a compiled engine pays for."""
        import torch._dynamo  # 2-4 s to import: only engines that compile pay for it

        self._pre_forward = torch._dynamo.disable(self._pre_forward)  # type: ignore[method-assign]
        self._post_forward = torch._dynamo.disable(self._post_forward)  # type: ignore[method-assign]
        self._frozen_reads.keep_eager()

    def parameter_offload(self) -> ParameterOffload:
        """DeepSpeed's `optimizer.parameter_offload`: the module hooks' handles (zero/parameter_offload.py)."""
        return self._offload

    def forget_order(self) -> None:
        self._exec.reset()

    def order_recorded(self) -> bool:
        return bool(self._exec.order)

    def __repr__(self) -> str:
        first, last = self._plan.buckets[self._persistent]
        return (f"Stage3Strategy({len(self._params)} params in {len(self._plan.buckets) - 1} units + "
                f"{last - first} persistent params, shard {self._plan.shard_numel} elements on rank "
                f"{self._comm.rank}, params on {self._shards.shard.device}, {self._shard!r})")

    @property
    def _order(self) -> list[int]:
        """The recorded unit order (zero/schedule.py)."""
        return self._exec.order

    # Read by tests: the units' full buffers, the shard, its NVMe home.
    @property
    def _full(self) -> list[Tensor]:
        return [unit.full for unit in self._units]

    @property
    def _lp_shard(self) -> Tensor:
        return self._shards.shard

    @property
    def _lp_home(self) -> "ShardHome | None":
        """The NVMe home (zero/offload/nvme_params.py), or None when the shard is in memory."""
        return None if isinstance(self._shards.home, InMemoryShard) else self._shards.home

    @property
    def _training(self) -> bool:
        return self._pass in (Pass.FORWARD, Pass.BACKWARD)

    # -- gather / release -----------------------------------------------------------------

    def _live_numel(self) -> int:
        return sum(unit.full.numel() for unit in self._units if not unit.released)

    def _start_gather(self, u: int, exact: bool = False) -> None:
        """Start gathering unit `u` along the route `UnitShards.gather_for` picks (hpZ's
        secondary partition, qwZ's int8 codes, or exact; Note: [exact gathers])."""
        unit = self._units[u]
        if not unit.released:
            return
        unit.start(self._shards.gather_for(u, exact), u)
        if self._training:  # the training working set; user gathers are the user's choice
            self.peak_live_numel = max(self.peak_live_numel, self._live_numel())

    def _gather(self, u: int, exact: bool = False) -> None:
        unit = self._units[u]
        if exact and not unit.released and not unit.exact:
            self._regather(u, exact=True)
            return
        self._start_gather(u, exact)
        if unit.finish():
            self._set_gathered(u, True)

    def _release(self, u: int, hand_off: bool = False) -> None:
        unit = self._units[u]
        if u == self._persistent or unit.released or unit.held:
            return
        unit.free(rebind=(lambda full: self._bind(u, full)) if hand_off else None)
        self._set_gathered(u, False)

    def _param_views(self, u: int, full: Tensor) -> Iterator[tuple[int, Tensor]]:
        """(index, view) of each parameter of unit `u` at its place in the flat buffer `full`."""
        plan = self._plan
        first, last = plan.buckets[u]
        for i in range(first, last):
            p = self._params[i]
            off = plan.param_flat_offsets[i] - plan.flat_offsets[u]
            yield i, full[off : off + p.numel()].view(p.shape)

    def _bind(self, u: int, full: Tensor) -> None:
        """Point unit `u`'s parameters at their places in the flat buffer `full`."""
        for i, view in self._param_views(u, full):
            assign_data(self._params[i], view)

    def _is_released(self, u: int) -> bool:
        return self._units[u].released

    def _set_gathered(self, u: int, gathered: bool) -> None:
        first, last = self._plan.buckets[u]
        for p in self._params[first:last]:
            p._zs.gathered = gathered  # type: ignore[attr-defined]

    def on_demand(self, params: list[ZeroParameter]) -> bool:
        """Parameters used outside their unit's forward during a forward: gather their units and
        keep them until the step's backward is done (saved views need them)."""
        if self._pass is Pass.IDLE:
            return False
        for unit in sorted({p._zs.unit for p in params}):
            self._units[unit].pinned = True
            self._gather(unit)
        return True

    def _unpin_all(self) -> None:
        for unit in self._units:
            unit.pinned = False

    def _regather(self, u: int, exact: bool) -> None:
        """Gather a gathered unit again (its storage stays allocated)."""
        self._units[u].invalidate()
        self._gather(u, exact)

    def _refresh_gathered(self) -> None:
        """The shards changed: rebuild the hpZ secondary partition, then the units gathered now
        (the persistent one, pinned ones) re-read their shards, each the kind of gather it held."""
        self._shards.refresh()
        for u, unit in enumerate(self._units):
            if not unit.released:
                self._regather(u, unit.exact)

    # -- hooks ----------------------------------------------------------------------------

    def _pre_forward(self, u: int) -> None:
        if _in_recompute():  # Note: [recompute under activation checkpointing]
            self._gather(u)
            self._prefetch.prefetch_backward(u, self._live_numel, self._is_released, self._start_gather)
            return
        if u == 0:  # the root: a new forward (and, when training, a new micro-batch)
            self._pass = Pass.FORWARD if torch.is_grad_enabled() else Pass.EVAL_FORWARD
            if self._pass is Pass.FORWARD:
                self._arrivals.reset()
                self._backward_started = set()  # units whose outputs' gradients arrived
                self._frozen_reads.reset()
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
                    and self._units[prev].full.numel() > self._opt.max_reuse_distance):
                self._release(prev)
            return None
        if not (torch.is_grad_enabled() and self._prefetch.reused_soon(u)):
            self._release(u)
        if u == 0:
            self._pass = Pass.BACKWARD if self._pass is Pass.FORWARD else Pass.IDLE
        if u == 0 and self._pass is Pass.IDLE:  # evaluation: nothing outlives the forward
            self._unpin_all()
            for v in range(len(self._plan.buckets)):
                self._release(v)
        return None

    def _on_grad_ready(self, index: int, param: Tensor) -> None:
        if not getattr(param, "ds_grad_is_ready", True):  # Note: [ds_grad_is_ready] in stage12.py
            return
        grad = param.grad
        if grad is None:
            return
        u = self._unit_of[index]
        off = self._plan.param_flat_offsets[index] - self._plan.flat_offsets[u]
        self._reducer.accumulate(u, self._units[u].full.numel(), off, grad, first=not self._arrivals.seen(index))
        param.grad = None
        for ready in self._arrivals.arrive(index):
            if ready != self._persistent:
                self._reduce(ready)
                if self._frozen_reads.grads_arrived(ready):  # else its frozen weights' last read releases it
                    self._release(ready)

    def _reduce(self, u: int) -> None:
        self._arrivals.mark_launched(u)
        data = self._reducer.staging(u, self._units[u].full.numel())  # zeros if no gradient arrived
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
        self._unpin_all()
        self._frozen_reads.reset()
        for u in range(len(self._plan.buckets)):
            self._release(u)
        self._exec.finish_recording()
        self._pass = Pass.IDLE

    def after_step(self, applied: bool) -> None:
        self._shard.after_step()
        self._reducer.end_step(release_pool=self._opt.release_grads)
        if applied and not self._shard.step_in_flight:  # in flight: published at the next settle_step
            self._publish_master()

    def _publish_master(self) -> None:
        self._shards.before_write()
        self._shard.store_master_to_lp()
        self._shards.refresh()
        self._shards.home.evict_all()  # the step wrote every shard: an NVMe home is on disk until next used
        # The persistent unit stays gathered: refresh it now. Other units gather on next use.
        self._regather(self._persistent, exact=True)

    def model_state_bytes(self, optimizer_state_bytes: int) -> list[ModelStateBytes]:
        acc = BytesByHome()
        persistent = self._units[self._persistent].full
        acc.add(self._device.type, "params", persistent.numel() * persistent.element_size())  # whole everywhere
        self._shards.count_bytes(acc, self._opt.offload_param.label(self._device), self._device)
        self._shard.count_bytes(acc, optimizer_state_bytes)
        return acc.result()

    def transient_bytes(self) -> int:
        """Bytes kept for reuse beyond the model states: the reducer's staging pool."""
        return self._reducer.pool_bytes()

    def state_tensors(self) -> dict[str, list[Tensor]]:
        """The shards' home, and every unit buffer that holds storage now (the persistent unit,
        units still gathered); released units hold none."""
        full = [u.full for u in self._units if u.full.untyped_storage().nbytes() > 0]
        return {"lp_params": [self._shards.home.tensor, *full], **self._shard.state_tensors(),
                "contiguous_grad_buffer": self._reducer.pool_blocks()}

    # -- user gathers (zero.GatheredParameters) --------------------------------------------

    def gather_params(self, params: Sequence[ZeroParameter]) -> None:
        """Gather the units of `params` for the user until `release_params`; collective."""
        for u in sorted({p._zs.unit for p in params}):  # every rank gathers in the same order
            self._units[u].user_pins += 1
            self._gather(u, exact=True)  # Note: [exact gathers]

    def release_params(self, params: Sequence[ZeroParameter], modifier_rank: int | None) -> None:
        """End a user gather; with `modifier_rank`, that rank's whole values become the truth."""
        for u in sorted({p._zs.unit for p in params}):
            unit = self._units[u]
            if modifier_rank is not None:
                self._comm.broadcast(unit.full, src=modifier_rank)
                chunk = self._shards.write(u, unit.full)
                master = self._shard.master_chunk(u)
                if master is not None:
                    master.copy_(chunk)
            unit.user_pins -= 1
            if unit.user_pins == 0:
                # Tensors the user took from the parameters inside the block (a state_dict,
                # `p.detach()`, which `.cpu()` returns unchanged on CPU) keep their values after
                # it, as under DeepSpeed (Note: [released storage]).
                self._release(u, hand_off=True)

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
        gradient capture] in pipe/schedules.py): start the arrivals and the reducer afresh."""
        self._arrivals.reset()
        self._backward_started = set()
        self._reducer.end_micro_batch()
        self._pass = Pass.BACKWARD

    def unit_of(self, param: ZeroParameter) -> int:
        return param._zs.unit

    # -- DeepSpeed's ds_* attributes (ZeroParameter's properties read these) ---------------

    def param_index(self, param: nn.Parameter) -> int:
        index = self._index_of
        if id(param) not in index:
            raise AssertionError(f"expected {param._zs.name if isinstance(param, ZeroParameter) else '?'} "
                                 "to be managed by this strategy")
        return index[id(param)]

    def local_shard(self, param: nn.Parameter) -> Tensor:
        """A view of this rank's piece of `param` in the low-precision shard (1-D; may be empty)."""
        index = self.param_index(param)
        for f in self._plan.rank_fragments(self._comm.rank):
            if f.param_index == index:
                return self._shards.shard[f.shard_offset : f.shard_offset + f.numel]
        return self._shards.shard[:0]

    def is_persistent(self, param: ZeroParameter) -> bool:
        return self.unit_of(param) == self._persistent

    # -- checkpoints (Note: [checkpoint fragments] in runtime/checkpoint_state.py) -------------

    def param_pieces(self) -> list[ParamPiece] | None:
        """This rank's low-precision pieces of every parameter (frozen ones included)."""
        return [ParamPiece(param=self._params[f.param_index], param_offset=f.param_offset, numel=f.numel,
                           data=self._shards.shard[f.shard_offset : f.shard_offset + f.numel])
                for f in self._plan.rank_fragments(self._comm.rank)]

    @torch.no_grad()
    def sync_params_from_master(self) -> None:
        self._shards.before_write()
        self._shard.store_master_to_lp()
        self._refresh_gathered()

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        self._shard.load_master_from_lp()
        self._refresh_gathered()
