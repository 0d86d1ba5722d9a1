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

from zeroshard.zero.flat import FlatLayout, param_views, plan_buckets
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


def broadcast_module_state(module: nn.Module, comm: "Comm", src: int = 0) -> None:
    """Make every rank's parameters and buffers equal to rank `src`'s (one collective per dtype)."""
    # zero.Init parameters are already rank 0's values, cut to shards: nothing to send.
    tensors = [t for t in list(module.parameters()) + list(module.buffers())
               if t.numel() > 0 and not hasattr(t, "_zs_init_shard")]
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in {id(t): t for t in tensors}.values():
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        comm.broadcast(flat, src=src)
        with torch.no_grad():
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


class Stage0Strategy:
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
    ) -> None:
        if not params:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        # Gradients become ready roughly in reverse registration order, so the flat buffer
        # is laid out reversed and buckets fill from its start during backward.
        self._params = list(reversed(params))
        self._comm = comm
        self._world_size = world_size
        self._comm_dtype = comm_dtype
        self._prescale_factor = prescale_factor
        self._layout = FlatLayout(tuple(p.numel() for p in self._params))
        device = self._params[0].device
        self._flat_grad = torch.zeros(self._layout.numel, dtype=grad_dtype, device=device)  # 1D
        self._grad_views = param_views(self._flat_grad, self._layout, [p.shape for p in self._params])
        self._init_buckets(reduce_bucket_numel)
        self._init_master_params()
        self._written = [False] * len(self._params)
        self._seen_in_micro = [False] * len(self._params)
        self._boundary = False
        self._handles: list["Handle"] = []
        for index, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(self._make_hook(index))

    def _init_buckets(self, reduce_bucket_numel: int) -> None:
        self._buckets = plan_buckets(self._layout.numels, reduce_bucket_numel)
        self._bucket_of = [0] * len(self._params)
        for b, (first, last) in enumerate(self._buckets):
            for i in range(first, last):
                self._bucket_of[i] = b
        self._pending = [last - first for first, last in self._buckets]
        self._next_bucket = 0

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
            f"{len(self._buckets)} buckets, grad dtype {self._flat_grad.dtype}, "
            f"comm dtype {self._comm_dtype or self._flat_grad.dtype}, mixed precision {self._mixed})"
        )

    # -- ZeroStrategy -------------------------------------------------------------------

    @property
    def optimizer_params(self) -> list[nn.Parameter]:
        # Back in registration order, so optimizer state lines up with model.parameters().
        return list(reversed(self._master))

    def master_params_for(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        try:
            return [self._master_of[id(p)] for p in params]
        except KeyError:
            raise ValueError(
                "the optimizer was given a parameter that is not a trainable parameter of the "
                "model passed to initialize(); build the optimizer from model.parameters()"
            ) from None

    def begin_micro_batch(self, boundary: bool) -> None:
        self._boundary = boundary
        self._seen_in_micro = [False] * len(self._params)

    def _make_hook(self, index: int):  # noqa: ANN202 (a closure over the index)
        def hook(param: Tensor) -> None:
            self._on_grad_ready(index, param)

        return hook

    def _on_grad_ready(self, index: int, param: Tensor) -> None:
        # Runs inside autograd, once per parameter per backward: fold the micro-batch
        # gradient into the flat buffer and free the parameter's own .grad.
        grad, view = param.grad, self._grad_views[index]
        if grad is None:
            return
        if self._written[index]:
            view.add_(grad)
        else:
            view.copy_(grad)
            self._written[index] = True
        param.grad = None
        if self._boundary and not self._seen_in_micro[index]:
            self._seen_in_micro[index] = True
            bucket = self._bucket_of[index]
            self._pending[bucket] -= 1
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # Buckets launch strictly in index order on every rank, so collectives pair up even
        # when ranks finish their gradients in a different order.
        while self._next_bucket < len(self._buckets) and self._pending[self._next_bucket] == 0:
            self._launch(self._next_bucket)

    def _launch(self, bucket: int) -> None:
        first, last = self._buckets[bucket]
        for i in range(first, last):
            if not self._written[i]:  # unused in every micro-batch of this step
                self._grad_views[i].zero_()
                self._written[i] = True
        start = self._layout.offsets[first]
        end = self._layout.offsets[last - 1] + self._layout.numels[last - 1]
        view = self._flat_grad[start:end]
        if self._prescale_factor != 1.0:
            view.mul_(1.0 / self._prescale_factor)
        if self._world_size > 1:
            self._handles.append(
                self._comm.all_reduce(view, async_op=True, comm_dtype=self._comm_dtype)
            )
        self._next_bucket = bucket + 1

    def after_backward(self) -> None:
        if not self._boundary:
            return
        while self._next_bucket < len(self._buckets):
            self._launch(self._next_bucket)
        for handle in self._handles:
            handle.wait()
        self._handles.clear()

    def prepare_step(self, grad_scale: float, max_norm: float) -> GradStats:
        # The flat buffer holds the sum over ranks (identical on every rank): no collective.
        mult = grad_scale * self._prescale_factor / self._world_size
        stats = unscale_and_clip([self._flat_grad], sum_of_squares([self._flat_grad]).item(), mult, max_norm)
        if not stats.overflow:
            attach_grads(self._master, self._grad_views)
        return stats

    def after_step(self, applied: bool) -> None:
        if applied and self._mixed:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self._params], [m.data for m in self._master])
        for master in self._master:
            master.grad = None
        self._written = [False] * len(self._params)
        self._pending = [last - first for first, last in self._buckets]
        self._next_bucket = 0

    def model_state_bytes(self, optimizer_state_bytes: int) -> list[ModelStateBytes]:
        def nbytes(ts: Sequence[Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        return [
            ModelStateBytes(
                params=nbytes(self._params),
                grads=nbytes([self._flat_grad]),
                master_params=nbytes(self._master) if self._mixed else 0,
                optimizer_states=optimizer_state_bytes,
                device=self._flat_grad.device.type,
            )
        ]

    # -- checkpoints (Note: [checkpoint fragments] in runtime/checkpointing.py) -------------

    def checkpoint_fragments(self) -> list[MasterFragment]:
        # One whole-parameter fragment per parameter, in registration order.
        return [MasterFragment(param=p, param_offset=0, numel=p.numel(), master=m)
                for p, m in zip(reversed(self._params), reversed(self._master))]

    def param_pieces(self) -> list[ParamPiece] | None:
        return None  # every rank holds the whole model

    def fragment_grads(self, grad_scale: float) -> list[Tensor]:
        mult = grad_scale * self._prescale_factor / self._world_size
        return [g.reshape(-1).float() * mult for g in reversed(self._grad_views)]

    @torch.no_grad()
    def sync_params_from_master(self) -> None:
        if self._mixed:
            torch._foreach_copy_([p.data for p in self._params], [m.data for m in self._master])

    @torch.no_grad()
    def sync_master_from_params(self) -> None:
        if self._mixed:
            torch._foreach_copy_([m.data for m in self._master], [p.data for p in self._params])
