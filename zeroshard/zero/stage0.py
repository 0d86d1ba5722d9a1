"""Stage 0: plain data parallelism, the reference every other stage must agree with.

Every rank holds the whole model, the whole gradient and the whole optimizer state.
Gradients are copied into one flat buffer (in `grad_dtype`, fp32 by default) as each
parameter's gradient is accumulated during backward, and the buffer is all-reduced in buckets
of `reduce_bucket_numel` elements, each launched as soon as its last gradient is ready, so
communication overlaps the rest of backward. Under fp16/bf16 the optimizer steps on fp32
master copies and the result is copied back into the model's low-precision weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from zeroshard.moe.utils import is_moe_param
from zeroshard.zero.flat import FlatLayout, plan_buckets
from zeroshard.zero.init_partition import init_partitioned
from zeroshard.zero.reduce import GradAccumulator, GradReducer, LaunchOrder, ReduceMode, ReduceOptions
from zeroshard.zero.strategy import (
    GradStats,
    MasterFragment,
    ModelParallelNorm,
    ModelStateBytes,
    ParamPiece,
    ZeroStrategy,
    attach_grads,
    sum_of_squares,
    unscale_and_clip,
)

if TYPE_CHECKING:
    from zeroshard.comm import Comm


def broadcast_module_state(module: nn.Module, comm: "Comm", src: int = 0) -> None:
    """Make every rank's parameters and buffers equal to rank `src`'s (one collective per dtype).

    Expert parameters are left out: ranks hold different experts, and moe/prepare.py makes each
    expert-data-parallel group agree on its own (as DeepSpeed broadcasts them)."""
    # zero.Init parameters are already rank 0's values, cut to shards: nothing to send.
    comm.broadcast_values([t for t in list(module.parameters()) + list(module.buffers())
                           if not init_partitioned(t) and not is_moe_param(t)], src=src)


class Stage0Strategy(ZeroStrategy):
    """Data parallel training with bucketed, overlapped gradient all-reduce.

    Args:
        params: the trainable parameters, each once (tied weights appear once).
        comm: collectives over the data-parallel group.
        world_size: data-parallel world size.
        grad_dtype: dtype of the flat gradient buffer where micro-batches accumulate and
            buckets are reduced (fp32 by default under fp16/bf16, `data_types.grad_accum_dtype`).
        comm_dtype: dtype on the wire (`communication_data_type`), None = `grad_dtype`.
        reduce_bucket_numel: elements per all-reduce bucket (`reduce_bucket_size`).
        prescale_factor: divide gradients by this before the all-reduce
            (`gradient_predivide_factor` with `prescale_gradients`), 1.0 = reduce then average.
        average: `gradient_allreduce_op` "mean" (True) or "sum" (False: the reduced gradient is
            the sum over ranks; `prescale_factor` is then 1).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        comm: "Comm",
        world_size: int,
        grad_dtype: torch.dtype,
        comm_dtype: torch.dtype | None,
        reduce_bucket_numel: int,
        prescale_factor: float = 1.0,
        average: bool = True,
        norm_group: ModelParallelNorm | None = None,
    ) -> None:
        # No trainable parameter: a frozen model for inference only (TRL's `prepare_deepspeed` gives its
        # reference model to deepspeed.initialize at stage 0), which DeepSpeed 0.19.8 accepts at stage 0
        # too; the strategy then has nothing to reduce or step.
        # Gradients become ready roughly in reverse registration order, so the flat buffer
        # is laid out reversed and buckets fill from its start during backward.
        self._params = list(reversed(params))
        self._comm = comm
        self._world_size = world_size
        self._comm_dtype = comm_dtype
        self._prescale_factor = prescale_factor
        self._average = average
        self._layout = FlatLayout(tuple(p.numel() for p in self._params))
        device = self._params[0].device if self._params else comm.groups.device
        flat = torch.zeros(self._layout.numel, dtype=grad_dtype, device=device)  # 1D
        self._grads = GradAccumulator(flat, self._layout.offsets, [p.shape for p in self._params])
        self._buckets = plan_buckets(self._layout.numels, reduce_bucket_numel)
        bucket_of = [b for b, (first, last) in enumerate(self._buckets) for _ in range(first, last)]
        self._order = LaunchOrder(bucket_of, [last - first for first, last in self._buckets], in_order=True)
        self._reducer = GradReducer(comm, ReduceOptions(mode=ReduceMode.ALL_REDUCE, grad_dtype=grad_dtype,
                                                        comm_dtype=comm_dtype, prescale_factor=prescale_factor),
                                    device=device)
        self._init_master_params()
        self._boundary = False
        self._reduce_grads = True  # set_grad_reduction: the 1-bit optimizers' compression stage
        self._reducing = True  # latched per micro-batch: whether this step's gradients are reduced
        self._norm_group = norm_group  # Note: [norm groups] in zero/strategy.py
        for index, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(lambda t, i=index: self._on_grad_ready(i, t))

    def _init_master_params(self) -> None:
        """fp32 master copies when the model is in fp16/bf16; the model's own params otherwise."""
        self._mixed = any(p.dtype != torch.float32 for p in self._params)
        if self._mixed:
            self._master = [nn.Parameter(p.detach().float().clone()) for p in self._params]
        else:
            self._master = list(self._params)
        self._master_of = {id(p): m for p, m in zip(self._params, self._master)}

    def __repr__(self) -> str:
        return (
            f"Stage0Strategy({len(self._params)} params, {self._layout.numel} elements, "
            f"{len(self._buckets)} buckets, grad dtype {self._grads.flat.dtype}, "
            f"comm dtype {self._comm_dtype or self._grads.flat.dtype}, mixed precision {self._mixed})"
        )

    # -- ZeroStrategy -------------------------------------------------------------------

    @property
    def optimizer_params(self) -> list[nn.Parameter]:
        # Back in registration order, so optimizer state lines up with model.parameters().
        return list(reversed(self._master))

    def master_params_for(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        try:  # a frozen parameter in a client optimizer's group is left out, as DeepSpeed does
            return [self._master_of[id(p)] for p in params if p.requires_grad or id(p) in self._master_of]
        except KeyError:
            raise ValueError(
                "the optimizer was given a parameter that is not a trainable parameter of the "
                "model passed to initialize(); build the optimizer from model.parameters()"
            ) from None

    def begin_micro_batch(self, boundary: bool) -> None:
        self._boundary = boundary
        self._reducing = self._reduce_grads
        self._order.reset()

    def keeps_local_grads(self) -> bool:
        return True

    def reduces_at_boundary_only(self) -> bool:
        return True

    def set_grad_reduction(self, enabled: bool) -> None:
        """Reduce gradients across ranks (True, the default) or keep each rank's own (False).

        The 1-bit optimizers (optim/onebit_adam.py) turn it off when their warm-up ends: they
        all-reduce the momentum themselves, compressed. Takes effect from the next micro-batch.
        With it off, `prepare_step` unscales and clips the local gradient, and the ranks agree on
        overflow and the norm with one 8-byte all-reduce (see `prepare_step`).
        """
        self._reduce_grads = bool(enabled)

    def _on_grad_ready(self, index: int, param: Tensor) -> None:
        # Runs inside autograd, once per parameter per backward: fold the micro-batch
        # gradient into the flat buffer and free the parameter's own .grad.
        if not getattr(param, "ds_grad_is_ready", True):  # Note: [ds_grad_is_ready] in stage12.py
            return
        grad = param.grad
        if grad is None:
            return
        self._grads.add(index, grad)
        param.grad = None
        if self._boundary and self._reducing:
            for bucket in self._order.arrive(index):
                self._launch(bucket)

    def _launch(self, bucket: int) -> None:
        first, last = self._buckets[bucket]
        self._order.mark_launched(bucket)
        self._grads.fill_unwritten(first, last)
        start = self._layout.offsets[first]
        end = self._layout.offsets[last - 1] + self._layout.numels[last - 1]
        self._reducer.launch(bucket, self._grads.flat[start:end])  # in place, every rank keeps it

    def after_backward(self) -> None:
        if not self._boundary or not self._reducing:
            return
        for bucket in self._order.remaining():
            self._launch(bucket)
        self._reducer.drain()

    def prepare_step(self, grad_scale: float, max_norm: float) -> GradStats:
        flat = self._grads.flat
        mult = self._grad_mult(grad_scale)
        norm_group = self._norm_group
        if self._reducing and norm_group is not None:
            # Identical on every dp rank; summed over the model-parallel group (zero/strategy.py).
            dup = [self._grads.flat[o : o + n] for o, n, p in zip(self._layout.offsets, self._layout.numels,
                                                                  self._params) if id(p) in norm_group.duplicates]
            sq_sum = norm_group.finish(sum_of_squares([flat]), dup).item()
        elif self._reducing:
            # The flat buffer holds the sum over ranks (identical on every rank): no collective.
            sq_sum = sum_of_squares([flat]).item()
        else:
            # Local gradients (1-bit compression stage): the norm is the root mean square of the
            # ranks' local norms, sqrt(sum_r ||g_r||^2 / N), so every rank clips by the same
            # coefficient, and an inf/nan on any rank makes the sum non-finite everywhere.
            sq = sum_of_squares([flat])
            self._comm.all_reduce(sq, "sum")
            sq_sum = sq.item() / self._world_size
        stats = unscale_and_clip([flat], sq_sum, mult, max_norm)
        if not stats.overflow:
            attach_grads(self._master, self._grads.views)
        return stats

    def after_step(self, applied: bool) -> None:
        if applied and self._mixed:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self._params], [m.data for m in self._master])
        for master in self._master:
            master.grad = None
        self._grads.reset()

    def model_state_bytes(self, optimizer_state_bytes: int) -> list[ModelStateBytes]:
        def nbytes(ts: Sequence[Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        return [
            ModelStateBytes(
                params=nbytes(self._params),
                grads=nbytes([self._grads.flat]),
                master_params=nbytes(self._master) if self._mixed else 0,
                optimizer_states=optimizer_state_bytes,
                device=self._grads.flat.device.type,
            )
        ]

    def transient_bytes(self) -> int:
        return 0  # buckets are reduced in place in the flat gradient

    def state_tensors(self) -> dict[str, list[Tensor]]:
        return {"lp_params": list(self._params), "hp_params": list(self._master), "lp_grads": [self._grads.flat],
                "contiguous_grad_buffer": self._reducer.pool_blocks()}

    # -- checkpoints (Note: [checkpoint fragments] in runtime/checkpoint_state.py) -------------

    def checkpoint_fragments(self) -> list[MasterFragment]:
        # One whole-parameter fragment per parameter, in registration order.
        return [MasterFragment(param=p, param_offset=0, numel=p.numel(), master=m)
                for p, m in zip(reversed(self._params), reversed(self._master))]

    def param_pieces(self) -> list[ParamPiece] | None:
        return None  # every rank holds the whole model

    def _grad_mult(self, grad_scale: float) -> float:
        """What turns the flat buffer into the averaged (or, for "sum", summed) unscaled gradient
        (local when not reducing)."""
        if not (self._reducing and self._average):
            return grad_scale
        return grad_scale * self._prescale_factor / self._world_size

    def fragment_grads(self, grad_scale: float) -> list[Tensor]:
        mult = self._grad_mult(grad_scale)
        return [g.reshape(-1).float() * mult for g in reversed(self._grads.views)]

    @torch.no_grad()
    def set_fragment_grad(self, index: int, value: Tensor, grad_scale: float) -> None:
        mult = self._grad_mult(grad_scale)
        self._grads.views[len(self._grads.views) - 1 - index].view(-1).copy_(value.reshape(-1) / mult)

    @torch.no_grad()
    def sync_params_from_master(self) -> None:
        if self._mixed:
            torch._foreach_copy_([p.data for p in self._params], [m.data for m in self._master])

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        if self._mixed:
            torch._foreach_copy_([m.data for m in self._master], [p.data for p in self._params])
