"""Stages 1 and 2: each rank keeps the master weights and optimizer state of its shard only.

Layout (see zero/flat.py): the model's parameters are packed, in backward order, into one
flat buffer of buckets, each split evenly over the ranks; a model parameter is a view into
it. Rank r's *shard* is chunk r of every bucket. The optimizer steps on *fragments*, the
pieces of parameters inside the shard, as separate tensors that are views of the fp32 master
shard (or, in fp32 without offload, of the flat buffer itself, so there is no second copy).

Stage 1 accumulates whole gradients locally and, on the last micro-batch of a step,
all-reduces each bucket as it fills and keeps its own chunk ("all-reduce then drop").
Stage 2 never holds a whole gradient: every micro-batch reduce-scatters each bucket as soon as
it fills, folding the result into the rank's gradient shard; at most two buckets are in flight
(`overlap_comm`), which bounds the transient staging memory to two buckets.

After the optimizer step each rank casts its master shard into its chunk of every bucket and
the chunks are all-gathered (or broadcast, `allgather_partitions: false`), bucket by bucket.
With `offload_optimizer`, the master shard, the gradient shard and the optimizer state live
in CPU memory and the step runs there (torch's fused CPU AdamW).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from zeroshard.zero.flat import BucketedPartition
from zeroshard.zero.strategy import (
    GradStats,
    MasterFragment,
    ModelStateBytes,
    ParamPiece,
    attach_grads,
    sum_of_squares,
    unscale_and_clip,
)

if TYPE_CHECKING:
    from zeroshard.comm import Comm, Handle

ALIGN_NUMEL = 16
"""Each rank's chunk of a bucket is a multiple of 16 elements (64 bytes in fp32)."""
MAX_BUCKETS_IN_FLIGHT = 2
"""Stage 2: reduce-scatters outstanding at once before backward waits for the oldest."""


@dataclass(frozen=True, slots=True)
class PartitionOptions:
    stage: int
    """1: shard optimizer state; 2: also shard gradients."""
    grad_dtype: torch.dtype
    """Where gradients accumulate and are reduced (fp32 by default)."""
    comm_dtype: torch.dtype | None
    bucket_numel: int
    """min(reduce_bucket_size, allgather_bucket_size): both collectives run per bucket."""
    prescale_factor: float = 1.0
    overlap_comm: bool = True
    reduce_scatter: bool = True
    """Stage 2: reduce-scatter each bucket (False: all-reduce it and keep this rank's chunk)."""
    allgather_partitions: bool = True
    offload_device: torch.device | None = None
    """Home of master shard, gradient shard and optimizer state (None: the model's device)."""
    pin_memory: bool = False


class PartitionedStrategy:
    """ZeRO stages 1 and 2 behind the `ZeroStrategy` protocol (zero/strategy.py)."""

    def __init__(self, params: Sequence[nn.Parameter], *, comm: "Comm", rank: int,
                 world_size: int, options: PartitionOptions) -> None:
        if not params:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"ZeRO stages 1/2 need one parameter dtype, found {sorted(map(str, dtypes))}")
        self._params = list(reversed(params))  # backward order: buckets fill front to back
        self._comm, self._rank, self._world = comm, rank, world_size
        self._opt = options
        self._plan = BucketedPartition([p.numel() for p in self._params], bucket_numel=options.bucket_numel,
                                       world_size=world_size, align=ALIGN_NUMEL)
        self._device = self._params[0].device
        # With offload the master shard, gradient shard and optimizer state get their own home,
        # separate from the model's buffers, even when the model's device is the CPU too.
        self._offload = options.offload_device is not None
        self._home = options.offload_device or self._device
        self._init_flat_params()
        self._init_master()
        self._init_grads()
        self._init_fragments()
        self._bucket_of = [b for b, (first, last) in enumerate(self._plan.buckets) for _ in range(first, last)]
        self._free_blocks: list[Tensor] = []             # stage 2 staging pool (see _staging_for)
        self._staging_blocks: dict[int, Tensor] = {}
        self._max_bucket_numel = max(layout.padded_numel for layout in self._plan.layouts)
        self._reset_step()
        self._micro_reset()
        for index, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(self._make_hook(index))

    # -- construction ---------------------------------------------------------------------

    def _init_flat_params(self) -> None:
        """Pack the model's parameters into one padded flat buffer; params become views."""
        dtype = self._params[0].dtype
        self._flat_params = torch.zeros(self._plan.padded_numel, dtype=dtype, device=self._device)  # 1D
        with torch.no_grad():
            for p, off in zip(self._params, self._plan.param_flat_offsets):
                view = self._flat_params[off : off + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view

    def _init_master(self) -> None:
        self._mixed = self._flat_params.dtype != torch.float32
        self._separate_master = self._mixed or self._offload
        self._master: Tensor | None = None  # 1D fp32, shard_numel, on self._home
        if self._separate_master:
            pin = self._opt.pin_memory and self._home.type == "cpu" and torch.cuda.is_available()
            self._master = torch.empty(self._plan.shard_numel, dtype=torch.float32, device=self._home,
                                       pin_memory=pin)
            for b in range(len(self._plan.buckets)):
                self._master[slice(*self._plan.shard_range(b))].copy_(self._own_chunk(self._flat_params, b))

    def _init_grads(self) -> None:
        opt = self._opt
        # Stage 1: whole gradients, accumulated locally, laid out like the parameters.
        self._full_grad: Tensor | None = None  # 1D grad_dtype, padded_numel
        if opt.stage == 1:
            self._full_grad = torch.zeros(self._plan.padded_numel, dtype=opt.grad_dtype, device=self._device)
        # The gradient shard: the reduced, owned part. Stage 1 without offload reads it in
        # place from the whole-gradient buffer, so no separate tensor exists.
        self._grad_shard: Tensor | None = None  # 1D grad_dtype, shard_numel, on self._home
        if opt.stage == 2 or self._offload:
            self._grad_shard = torch.zeros(self._plan.shard_numel, dtype=opt.grad_dtype, device=self._home)

    def _init_fragments(self) -> None:
        self._fragments = self._plan.rank_fragments(self._rank)
        self._master_of: dict[int, nn.Parameter] = {}
        self._fragment_params: list[nn.Parameter] = []
        self._fragment_grads: list[Tensor] = []
        for f in self._fragments:
            if self._master is not None:
                data = self._master[f.shard_offset : f.shard_offset + f.numel]
            else:
                data = self._flat_params[f.flat_offset : f.flat_offset + f.numel]
            frag = nn.Parameter(data, requires_grad=True)  # shares storage with the shard
            self._fragment_params.append(frag)
            self._master_of[id(self._params[f.param_index])] = frag
            if self._grad_shard is not None:
                self._fragment_grads.append(self._grad_shard[f.shard_offset : f.shard_offset + f.numel])
            else:
                assert_full = self._full_grad
                if assert_full is None:
                    raise AssertionError("expected a whole-gradient buffer at stage 1")
                self._fragment_grads.append(assert_full[f.flat_offset : f.flat_offset + f.numel])

    def _own_chunk(self, flat: Tensor, bucket: int) -> Tensor:
        return flat[slice(*self._plan.chunk_range(bucket, self._rank))]

    def _own_chunk_of_bucket(self, bucket_data: Tensor, bucket: int) -> Tensor:
        """This rank's chunk of a tensor holding one whole bucket."""
        return bucket_data[slice(*self._plan.layouts[bucket].partition(self._rank))]

    def _grad_view(self, index: int) -> Tensor:
        off, n = self._plan.param_flat_offsets[index], self._params[index].numel()
        if self._full_grad is None:
            raise AssertionError("expected a whole-gradient buffer at stage 1")
        return self._full_grad[off : off + n].view_as(self._params[index])

    def __repr__(self) -> str:
        return (f"PartitionedStrategy(stage {self._opt.stage}, {len(self._params)} params, "
                f"{self._plan.numel} elements in {len(self._plan.buckets)} buckets, shard "
                f"{self._plan.shard_numel} elements, {len(self._fragments)} fragments on rank "
                f"{self._rank}, grad dtype {self._opt.grad_dtype}, master on {self._home})")

    # -- ZeroStrategy ---------------------------------------------------------------------

    @property
    def optimizer_params(self) -> list[nn.Parameter]:
        return list(self._fragment_params)

    def master_params_for(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        out = []
        for p in params:
            if not any(p is q for q in self._params):
                raise ValueError("the optimizer was given a parameter that is not a trainable "
                                 "parameter of the model passed to initialize()")
            if id(p) in self._master_of:
                out.append(self._master_of[id(p)])
        return out

    def _reset_step(self) -> None:
        self._written = [False] * len(self._params)       # stage 1: full grad holds this step's data
        self._folded = [False] * len(self._plan.buckets)  # stage 2: shard chunk holds this step's data

    def _micro_reset(self) -> None:
        self._pending = [last - first for first, last in self._plan.buckets]
        self._seen = [False] * len(self._params)
        self._next_bucket = 0
        self._free_blocks.extend(self._staging_blocks.values())  # none left after a full backward
        self._staging_blocks.clear()
        self._staging: dict[int, Tensor] = {}
        self._in_flight: list[tuple[int, "Handle", Tensor, Tensor]] = []

    def begin_micro_batch(self, boundary: bool) -> None:
        self._boundary = boundary
        self._micro_reset()

    def _reduces_now(self) -> bool:
        return self._opt.stage == 2 or self._boundary

    def _make_hook(self, index: int):  # noqa: ANN202 (a closure over the index)
        def hook(param: Tensor) -> None:
            self._on_grad_ready(index, param)

        return hook

    def _on_grad_ready(self, index: int, param: Tensor) -> None:
        # Inside autograd, once per parameter per backward (Note: [step protocol]).
        grad = param.grad
        if grad is None:
            return
        if self._opt.stage == 1:
            view = self._grad_view(index)
            view.add_(grad) if self._written[index] else view.copy_(grad)
            self._written[index] = True
        else:
            bucket = self._bucket_of[index]
            staging = self._staging_for(bucket)
            start = self._plan.param_flat_offsets[index] - self._plan.flat_offsets[bucket]
            view = staging[start : start + param.numel()].view_as(param)
            view.add_(grad) if self._seen[index] else view.copy_(grad)
        param.grad = None
        if not self._seen[index]:
            self._seen[index] = True
            if self._reduces_now():
                self._pending[self._bucket_of[index]] -= 1
                while self._next_bucket < len(self._plan.buckets) and self._pending[self._next_bucket] == 0:
                    self._launch(self._next_bucket)

    def _staging_for(self, bucket: int) -> Tensor:
        # Staging buffers come from a small pool of bucket-sized blocks reused every
        # micro-batch: allocating and freeing them per bucket cost page faults and peak RSS.
        if bucket not in self._staging:
            numel = self._plan.layouts[bucket].padded_numel
            block = self._free_blocks.pop() if self._free_blocks else torch.empty(
                self._max_bucket_numel, dtype=self._opt.grad_dtype, device=self._device)
            self._staging_blocks[bucket] = block
            self._staging[bucket] = block[:numel].zero_()
        return self._staging[bucket]

    def _launch(self, bucket: int) -> None:
        # Buckets launch in index order on every rank, so collectives always pair up.
        self._next_bucket = bucket + 1
        scale = 1.0 / self._opt.prescale_factor
        if self._opt.stage == 1:
            first, last = self._plan.buckets[bucket]
            for i in range(first, last):
                if not self._written[i]:  # unused in every micro-batch of the step
                    self._grad_view(i).zero_()
                    self._written[i] = True
            if self._full_grad is None:
                raise AssertionError("expected a whole-gradient buffer at stage 1")
            data = self._full_grad[slice(*self._plan.bucket_range(bucket))]
            if scale != 1.0:
                data.mul_(scale)
            handle = self._comm.all_reduce(data, async_op=True, comm_dtype=self._opt.comm_dtype)
            self._in_flight.append((bucket, handle, data, data))
        else:
            staging = self._staging_for(bucket)
            if scale != 1.0:
                staging.mul_(scale)
            if self._opt.reduce_scatter:
                recv = torch.empty(self._plan.layouts[bucket].partition_numel, dtype=staging.dtype,
                                   device=self._device)
                handle = self._comm.reduce_scatter(recv, staging, async_op=True, comm_dtype=self._opt.comm_dtype)
            else:
                handle = self._comm.all_reduce(staging, async_op=True, comm_dtype=self._opt.comm_dtype)
                recv = self._own_chunk_of_bucket(staging, bucket)
            self._in_flight.append((bucket, handle, staging, recv))
        limit = MAX_BUCKETS_IN_FLIGHT if self._opt.overlap_comm else 0
        while len(self._in_flight) > limit:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        bucket, handle, _, result = self._in_flight.pop(0)
        handle.wait()
        self._staging.pop(bucket, None)  # staging memory goes back to the pool here
        block = self._staging_blocks.pop(bucket, None)
        if block is not None:
            self._free_blocks.append(block)
        if self._grad_shard is None:
            return  # stage 1 in place: the owned chunk of the whole gradient is the shard
        # Stage 2 received its chunk; stage 1 (offloaded) keeps its chunk of the reduced bucket.
        own = result if self._opt.stage == 2 else self._own_chunk_of_bucket(result, bucket)
        target = self._grad_shard[slice(*self._plan.shard_range(bucket))]
        if self._opt.stage == 2 and self._folded[bucket]:
            target.add_(own.to(target.device, non_blocking=True))
        else:
            target.copy_(own, non_blocking=True)
            self._folded[bucket] = True

    def after_backward(self) -> None:
        if not self._reduces_now():
            return
        while self._next_bucket < len(self._plan.buckets):
            self._launch(self._next_bucket)
        while self._in_flight:
            self._finish_oldest()

    def _shard_grad_views(self) -> list[Tensor]:
        if self._grad_shard is not None:
            return [self._grad_shard]
        if self._full_grad is None:
            raise AssertionError("expected a whole-gradient buffer at stage 1")
        return [self._own_chunk(self._full_grad, b) for b in range(len(self._plan.buckets))]

    def prepare_step(self, grad_scale: float, max_norm: float) -> GradStats:
        # Sum of squares of this rank's shard, one all-reduce for the global norm.
        views = self._shard_grad_views()
        sq = sum_of_squares(views).to(self._device)
        self._comm.all_reduce(sq)
        mult = grad_scale * self._opt.prescale_factor / self._world
        stats = unscale_and_clip(views, sq.item(), mult, max_norm)
        if not stats.overflow:
            attach_grads(self._fragment_params, self._fragment_grads)
        return stats

    def after_step(self, applied: bool) -> None:
        for frag in self._fragment_params:
            frag.grad = None
        self._reset_step()
        if applied:
            self._gather_params()

    def _gather_params(self) -> None:
        handles = []
        for b in range(len(self._plan.buckets)):
            out = self._flat_params[slice(*self._plan.bucket_range(b))]
            if self._master is not None:
                mine = self._master[slice(*self._plan.shard_range(b))].to(self._device, out.dtype)
            else:
                mine = self._own_chunk(self._flat_params, b).clone()  # all-gather input must not alias
            if self._opt.allgather_partitions:
                handles.append(self._comm.all_gather(out, mine, async_op=True))
            else:
                self._own_chunk(self._flat_params, b).copy_(mine)
                for src in range(self._world):
                    chunk = self._flat_params[slice(*self._plan.chunk_range(b, src))]
                    handles.append(self._comm.broadcast(chunk, src=src, async_op=True))
        for h in handles:
            h.wait()

    def model_state_bytes(self, optimizer_state_bytes: int) -> list[ModelStateBytes]:
        def nbytes(t: Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        offloaded = self._offload
        shard_grad = nbytes(self._grad_shard)
        device = ModelStateBytes(
            params=nbytes(self._flat_params),
            grads=nbytes(self._full_grad) + (0 if offloaded else shard_grad),
            master_params=0 if offloaded else nbytes(self._master),
            optimizer_states=0 if offloaded else optimizer_state_bytes,
            device=self._device.type,
        )
        if not offloaded:
            return [device]
        home = ModelStateBytes(params=0, grads=shard_grad, master_params=nbytes(self._master),
                               optimizer_states=optimizer_state_bytes, device=f"{self._home.type} (offload)")
        return [device, home]

    # -- checkpoints (Note: [checkpoint fragments] in runtime/checkpointing.py) -------------

    def checkpoint_fragments(self) -> list[MasterFragment]:
        return [MasterFragment(param=self._params[f.param_index], param_offset=f.param_offset,
                               numel=f.numel, master=frag)
                for f, frag in zip(self._fragments, self._fragment_params)]

    def param_pieces(self) -> list[ParamPiece] | None:
        return None  # every rank holds the whole model (the all-gathered flat buffer)

    def fragment_grads(self, grad_scale: float) -> list[Tensor]:
        mult = grad_scale * self._opt.prescale_factor / self._world
        return [g.float() * mult for g in self._fragment_grads]

    @torch.no_grad()
    def sync_params_from_master(self) -> None:
        self._gather_params()  # each rank casts its master shard into its chunks; all-gather

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        if self._master is None:
            return  # fp32 without offload: the fragments are views of the parameters
        for b in range(len(self._plan.buckets)):
            self._master[slice(*self._plan.shard_range(b))].copy_(self._own_chunk(self._flat_params, b))
