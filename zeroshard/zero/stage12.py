"""Stages 1 and 2: each rank keeps the master weights and optimizer state of its shard only.

Layout (see zero/flat.py): the model's parameters are packed, in backward order, into one
flat buffer of buckets, each split evenly over the ranks; a model parameter is a view into
it. Rank r's *shard* is chunk r of every bucket; the optimizer shard (zero/shard.py) steps
on its fragments, and the one gradient reducer (zero/reduce.py) reduces the buckets.

The two stages differ only in where gradients wait before the reduction:
- Stage 1 accumulates whole gradients locally and, on the last micro-batch of a step,
  all-reduces each bucket as it fills and keeps its own chunk ("all-reduce then drop").
- Stage 2 never holds a whole gradient: every micro-batch, each bucket is reduced from a pooled
  staging block as soon as it fills and folded into the rank's gradient shard.

After the optimizer step each rank casts its master shard into its chunk of every bucket and
the chunks are all-gathered (or broadcast, `allgather_partitions: false`), bucket by bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from zeroshard.errors import UsageError
from zeroshard.zero.flat import BucketedPartition
from zeroshard.zero.offload.policy import OffloadPolicy
from zeroshard.zero.reduce import GradAccumulator, GradReducer, LaunchOrder, ReduceMode, ReduceOptions
from zeroshard.zero.shard import OptimizerShard, ShardedStrategyBase
from zeroshard.zero.strategy import BytesByHome, ModelParallelNorm, ModelStateBytes, ParamPiece

if TYPE_CHECKING:
    from zeroshard.comm import Comm, Handle

ALIGN_NUMEL = 16
"""Each rank's chunk of a bucket is a multiple of 16 elements (64 bytes in fp32)."""


@dataclass(frozen=True, slots=True)
class PartitionOptions:
    grad_dtype: torch.dtype
    """Where gradients accumulate and are reduced (fp32 by default)."""
    comm_dtype: torch.dtype | None
    bucket_numel: int
    """min(reduce_bucket_size, allgather_bucket_size): both collectives run per bucket."""
    prescale_factor: float = 1.0
    average: bool = True
    """`gradient_allreduce_op`: "mean" (True) or "sum" (False, with prescale_factor 1)."""
    master_dtype: torch.dtype = torch.float32
    """dtype of the master shard (bf16 with `bf16.bf16_master_weights_and_grads`)."""
    overlap_comm: bool = True
    reduce_scatter: bool = True
    """Stage 2: reduce-scatter each bucket (False: all-reduce it and keep this rank's chunk)."""
    allgather_partitions: bool = True
    offload: OffloadPolicy = OffloadPolicy()
    """Home of master shard, gradient shard and optimizer state (`offload_optimizer`)."""
    ignore_unused: bool = True
    """`ignore_unused_parameters`: False raises at the step's last backward when a trainable
    parameter got no gradient in the whole step (they are zero-filled otherwise)."""
    param_names: tuple[str, ...] = ()
    """The parameters' names, in the order given (for that error)."""


class PartitionedStrategy(ShardedStrategyBase):
    """What stages 1 and 2 share, behind the `ZeroStrategy` protocol (zero/strategy.py).

    Subclasses say where a gradient goes when it arrives (`_accumulate`), what a bucket's
    data is when it launches (`_bucket_data`) and whether every micro-batch reduces.
    """

    _reduces_every_micro_batch: bool

    def __init__(self, params: Sequence[nn.Parameter], *, comm: "Comm", rank: int,
                 world_size: int, options: PartitionOptions, norm_group: ModelParallelNorm | None = None) -> None:
        if not params:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"ZeRO stages 1/2 need one parameter dtype, found {sorted(map(str, dtypes))}")
        self._params = list(reversed(params))  # backward order: buckets fill front to back
        self._comm, self._rank, self._world = comm, rank, world_size
        self._opt = options
        self._prescale_factor = options.prescale_factor
        self._average = options.average
        self._plan = BucketedPartition([p.numel() for p in self._params], bucket_numel=options.bucket_numel,
                                       world_size=world_size, align=ALIGN_NUMEL)
        self._device = self._params[0].device
        self._init_flat_params()
        self._init_grads()
        self._shard = OptimizerShard(self._plan, comm, self._params, trainable=[True] * len(self._params),
                                     lp=self._flat_params, lp_is_flat=True, device=self._device,
                                     policy=options.offload, grad_dtype=options.grad_dtype,
                                     master_dtype=options.master_dtype, whole_grads=self._whole_grads(),
                                     norm_group=norm_group)
        bucket_of = [b for b, (first, last) in enumerate(self._plan.buckets) for _ in range(first, last)]
        self._order = LaunchOrder(bucket_of, [last - first for first, last in self._plan.buckets], in_order=True)
        self._reducer = GradReducer(comm, ReduceOptions(
            mode=self._reduce_mode(), grad_dtype=options.grad_dtype, comm_dtype=options.comm_dtype,
            prescale_factor=options.prescale_factor, overlap_comm=options.overlap_comm),
            device=self._device, block_numel=max(layout.padded_numel for layout in self._plan.layouts))
        self._boundary = False
        self._used = [False] * len(self._params)  # got a gradient in this step (ignore_unused)
        for index, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(lambda t, i=index: self._on_grad_ready(i, t))

    def _init_flat_params(self) -> None:
        """Pack the model's parameters into one padded flat buffer; params become views."""
        dtype = self._params[0].dtype
        self._flat_params = torch.zeros(self._plan.padded_numel, dtype=dtype, device=self._device)  # 1D
        with torch.no_grad():
            for p, off in zip(self._params, self._plan.param_flat_offsets):
                view = self._flat_params[off : off + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view

    # -- what the stages specialise -----------------------------------------------------------

    def _init_grads(self) -> None: ...

    def _whole_grads(self) -> Tensor | None:
        return None

    def _reduce_mode(self) -> ReduceMode: ...

    def _accumulate(self, index: int, grad: Tensor) -> None: ...

    def _bucket_data(self, bucket: int) -> Tensor: ...

    def _reset_step(self) -> None: ...

    def _whole_grad_bytes(self) -> int:
        return 0

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self._params)} params, {self._plan.numel} elements in "
                f"{len(self._plan.buckets)} buckets, {self._reducer.mode.value}, grad dtype "
                f"{self._opt.grad_dtype}, {self._shard!r} on rank {self._rank})")

    # -- ZeroStrategy -------------------------------------------------------------------------

    def begin_micro_batch(self, boundary: bool) -> None:
        self._boundary = boundary
        self._order.reset()
        self._reducer.end_micro_batch()

    def reduces_at_boundary_only(self) -> bool:
        return not self._reduces_every_micro_batch

    def _reduces_now(self) -> bool:
        return self._reduces_every_micro_batch or self._boundary

    def _on_grad_ready(self, index: int, param: Tensor) -> None:
        # Inside autograd, once per parameter per backward (Note: [step protocol]).
        # Note: [ds_grad_is_ready] A caller that accumulates one parameter's gradient over several
        # autograd calls inside one backward (axolotl's tiled MLP runs each tile's backward itself)
        # sets DeepSpeed's `param.ds_grad_is_ready = False` for all but the last; the gradient then
        # stays in `param.grad`, summing, and is taken once, when the flag is back to True (or
        # absent), as DeepSpeed's ZeRO hooks do.
        if not getattr(param, "ds_grad_is_ready", True):
            return
        grad = param.grad
        if grad is None:
            return
        self._used[index] = True
        self._accumulate(index, grad)
        param.grad = None
        if self._reduces_now():
            for bucket in self._order.arrive(index):
                self._launch(bucket)

    def _launch(self, bucket: int) -> None:
        self._order.mark_launched(bucket)
        self._reducer.launch(bucket, self._bucket_data(bucket), self._shard.grad_target(bucket))

    def after_backward(self) -> None:
        if self._reduces_now():
            for bucket in self._order.remaining():
                self._launch(bucket)
            self._reducer.drain()
        if self._boundary and not self._opt.ignore_unused:
            self._check_every_param_used()

    def _check_every_param_used(self) -> None:
        names = list(reversed(self._opt.param_names)) or [f"#{i}" for i in range(len(self._params))]
        unused = [names[i] for i, used in enumerate(self._used) if not used]
        if unused:
            raise UsageError(
                f"zero_optimization.ignore_unused_parameters is false and {len(unused)} trainable parameter(s) "
                f"got no gradient in this optimizer step: {', '.join(reversed(unused))}. Use every trainable "
                "parameter in the loss, freeze the unused ones (requires_grad=False), or set "
                "ignore_unused_parameters to true (DeepSpeed's default: they get a zero gradient).")

    def after_step(self, applied: bool) -> None:
        self._used = [False] * len(self._params)
        self._shard.after_step()
        self._reducer.end_step()
        self._reset_step()
        if applied and not self._shard.step_in_flight:  # in flight: published at the next settle_step
            self._gather_params()

    def _publish_master(self) -> None:
        self._gather_params()

    def _own_chunk(self, bucket: int) -> Tensor:
        return self._flat_params[slice(*self._plan.chunk_range(bucket, self._rank))]

    def _gather_params(self) -> None:
        handles = []
        with self._comm.issued_together(waited_next=True):  # one collective check for the burst
            self._issue_param_gathers(handles)
        for h in handles:
            h.wait()

    def _issue_param_gathers(self, handles: list[Handle]) -> None:
        for b in range(len(self._plan.buckets)):
            out = self._flat_params[slice(*self._plan.bucket_range(b))]
            master = self._shard.master_chunk(b)
            if master is not None:
                mine = master.to(self._device, out.dtype)
            else:
                mine = self._own_chunk(b).clone()  # all-gather input must not alias
            if self._opt.allgather_partitions:
                handles.append(self._comm.all_gather(out, mine, async_op=True))
            else:
                self._own_chunk(b).copy_(mine)
                for src in range(self._world):
                    chunk = self._flat_params[slice(*self._plan.chunk_range(b, src))]
                    handles.append(self._comm.broadcast(chunk, src=src, async_op=True))

    def model_state_bytes(self, optimizer_state_bytes: int) -> list[ModelStateBytes]:
        acc = BytesByHome()
        here = self._device.type
        acc.add(here, "params", self._flat_params.numel() * self._flat_params.element_size())
        acc.add(here, "grads", self._whole_grad_bytes())
        self._shard.count_bytes(acc, optimizer_state_bytes)
        return acc.result()

    def transient_bytes(self) -> int:
        """Bytes kept for reuse beyond the model states: the reducer's staging pool."""
        return self._reducer.pool_bytes()

    def state_tensors(self) -> dict[str, list[Tensor]]:
        return {"lp_params": [self._flat_params], **self._shard.state_tensors(),
                "contiguous_grad_buffer": self._reducer.pool_blocks()}

    # -- checkpoints (Note: [checkpoint fragments] in runtime/checkpoint_state.py) ---------------

    def param_pieces(self) -> list[ParamPiece] | None:
        return None  # every rank holds the whole model (the all-gathered flat buffer)

    @torch.no_grad()
    def sync_params_from_master(self) -> None:
        self._gather_params()  # each rank casts its master shard into its chunks; all-gather

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        self._shard.load_master_from_lp()


class Stage1Strategy(PartitionedStrategy):
    """Stage 1: whole gradients accumulate locally; the last micro-batch all-reduces them."""

    _reduces_every_micro_batch = False

    def _init_grads(self) -> None:
        flat = torch.zeros(self._plan.padded_numel, dtype=self._opt.grad_dtype, device=self._device)  # 1D
        self._grads = GradAccumulator(flat, self._plan.param_flat_offsets, [p.shape for p in self._params])

    def _whole_grads(self) -> Tensor | None:
        return self._grads.flat

    def _reduce_mode(self) -> ReduceMode:
        # In place; with offload the own chunk is folded into the shard at the optimizer's home.
        return ReduceMode.ALL_REDUCE_KEEP_CHUNK if self._opt.offload.offloaded else ReduceMode.ALL_REDUCE

    def _accumulate(self, index: int, grad: Tensor) -> None:
        self._grads.add(index, grad)

    def _bucket_data(self, bucket: int) -> Tensor:
        self._grads.fill_unwritten(*self._plan.buckets[bucket])
        return self._grads.flat[slice(*self._plan.bucket_range(bucket))]

    def _reset_step(self) -> None:
        self._grads.reset()

    def _whole_grad_bytes(self) -> int:
        return self._grads.flat.numel() * self._grads.flat.element_size()


class Stage2Strategy(PartitionedStrategy):
    """Stage 2: every micro-batch reduces each bucket from a pooled staging block."""

    _reduces_every_micro_batch = True

    def _reduce_mode(self) -> ReduceMode:
        return ReduceMode.REDUCE_SCATTER if self._opt.reduce_scatter else ReduceMode.ALL_REDUCE_KEEP_CHUNK

    def _accumulate(self, index: int, grad: Tensor) -> None:
        bucket = self._order.bucket_of(index)
        offset = self._plan.param_flat_offsets[index] - self._plan.flat_offsets[bucket]
        self._reducer.accumulate(bucket, self._plan.layouts[bucket].padded_numel, offset, grad,
                                 first=not self._order.seen(index))

    def _bucket_data(self, bucket: int) -> Tensor:
        return self._reducer.staging(bucket, self._plan.layouts[bucket].padded_numel)
