"""The interface between the engine and a ZeRO stage.

The engine never asks which stage it runs; it calls these methods in this order for every
micro-batch and step (Note: [step protocol]):

    begin_micro_batch(boundary)      before the forward of each micro-batch
    ... forward, loss.backward() ...  gradient hooks fire; buckets launch at the boundary
    after_backward()                  the boundary micro-batch: all reductions finished
    prepare_step(grad_scale, max_norm) -> GradStats   norm, overflow; grads scaled and clipped
    optimizer.step()                  only when not overflowed
    after_step(applied)               copy master weights back; reset gradient state

A strategy subclasses `ZeroStrategy` (a Protocol with bodies): what one stage alone can do (an
NVMe home that swaps the optimizer's states, local gradients for the 1-bit optimizers) is a
method here with a default, overridden where supported; callers never probe with `hasattr`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from zeroshard.comm import Comm
    from zeroshard.zero.parameter_offload import ParameterOffload

_SQ_CHUNK_NUMEL = 1 << 16
"""Elements converted to float64 at a time: stays in cache, so the float64 sum costs ~2x the
fp32 norm on CPU instead of ~40x for a float64 reduction over the whole tensor."""


def sum_of_squares(tensors: Sequence[Tensor]) -> Tensor:
    """Sum of squares of every element of `tensors`, accumulated in float64 (1-element tensor).

    Note: [norm rounding] Every stage sums the same squares in a different grouping (whole
    buffer, per bucket chunk, per unit shard). In float64 the groupings agree to ~1e-16, so the
    fp32 clip multiplier is the same at every stage and stages 1-3 stay bitwise equal to stage 0;
    with fp32 sums, one differing rounding of the multiplier made bf16 runs drift apart by up to
    10% over 20 steps (measured in tests/dist/test_zero12.py's scenario).
    """
    acc = torch.zeros((), dtype=torch.float64, device=tensors[0].device if tensors else "cpu")
    for t in tensors:
        flat = t.reshape(-1)
        if flat.device.type != "cpu":  # device kernels reduce in float64 at full speed
            acc += torch.linalg.vector_norm(flat, dtype=torch.float64).pow(2)
            continue
        for chunk in flat.split(_SQ_CHUNK_NUMEL):
            c = chunk.double()
            acc += torch.dot(c, c)
    return acc.reshape(1)


def unscale_and_clip(grads: Sequence[Tensor], sq_sum: float, mult: float, max_norm: float) -> "GradStats":
    """The shared end of every stage's `prepare_step`.

    `grads` hold the sum over ranks of the (loss-scaled) gradients, `sq_sum` the global sum of
    their squares, `mult` the factor that averages and unscales them. One in-place multiply
    averages, unscales and clips; nothing is touched when the step overflowed.
    """
    norm = math.sqrt(sq_sum) * mult if math.isfinite(sq_sum) else float("inf")
    if not math.isfinite(norm):
        return GradStats(norm=norm, overflow=True)
    coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
    if mult * coef != 1.0:
        torch._foreach_mul_(list(grads), mult * coef)
    return GradStats(norm=norm, overflow=False)


@dataclass(frozen=True, slots=True)
class ModelParallelNorm:
    """How the gradient norm spans the model-parallel ranks.

    Note: [norm groups] The gradient norm is global. ZeRO's strategy sums squares over its
    data-parallel group (the ranks holding the other parts of the same parameters); then this
    rank drops the squares of `duplicates` and the sum runs over `comm`, the norm group: the ranks
    holding different parts of one model replica, ``MeshGroups.axes("pp", "tp")`` (comm/topology.py)
    or an `mpu`'s model-parallel group. One rule for what is counted once: a parameter several
    ranks of the norm group hold whole (a weight AutoTP or the script did not split, held by every
    tensor-parallel rank; a tied weight held by several pipeline stages, its gradient summed over
    them before the step) is counted by its first holder only. The strategy is built with it
    (`build_strategy(norm_group=...)`) and clips by the global norm itself. An inf/nan anywhere
    makes the sum non-finite on every rank of the world, so the fp16 overflow vote spans the world.
    """

    comm: "Comm"
    """The model-parallel group (the ranks holding different pieces of one model replica)."""
    duplicates: frozenset[int]
    """ids of the parameters whose squares this rank leaves out (empty on the group's first rank)."""

    def finish(self, sq: Tensor, duplicate_grads: Sequence[Tensor]) -> Tensor:
        """`sq` (1-element float64, summed over data-parallel ranks where the caller does so)
        minus the squares of `duplicate_grads`, summed over the model-parallel group."""
        if duplicate_grads:
            sq = sq - sum_of_squares(duplicate_grads).to(sq.device)
        sq = sq.contiguous()
        self.comm.all_reduce(sq)
        return sq


def attach_grads(params: Sequence[nn.Parameter], grads: Sequence[Tensor]) -> None:
    """Give the optimizer's parameters their gradients (cast when the buffers' dtype differs)."""
    for p, g in zip(params, grads):
        p.grad = g if g.dtype == p.dtype else g.to(p.dtype)


@dataclass(frozen=True, slots=True)
class GradStats:
    """The global gradient norm of one step.

    `norm` is the L2 norm over all parameters of the data-parallel averaged, unscaled
    gradient, before clipping (the same meaning at every stage). `overflow` is True when any
    gradient element on any rank was inf or nan; the step is then skipped everywhere.
    """

    norm: float
    overflow: bool


@dataclass(frozen=True, slots=True)
class ModelStateBytes:
    """Bytes of model states held by this rank, by category and home."""

    params: int
    grads: int
    master_params: int
    optimizer_states: int
    device: str
    """The device type where these bytes live ("cpu", "cuda")."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master_params + self.optimizer_states


class BytesByHome:
    """Collects model-state bytes by home, in first-seen order, into `ModelStateBytes`."""

    _KEYS = ("params", "grads", "master_params", "optimizer_states")

    def __init__(self) -> None:
        self._homes: dict[str, dict[str, int]] = {}

    def add(self, home: str, key: str, nbytes: int) -> None:
        if key not in self._KEYS:
            raise AssertionError(f"expected one of {self._KEYS}, got {key!r}")
        entry = self._homes.setdefault(home, dict.fromkeys(self._KEYS, 0))
        entry[key] += nbytes

    def result(self) -> list[ModelStateBytes]:
        return [ModelStateBytes(device=home, **v) for home, v in self._homes.items()]


@dataclass(frozen=True, slots=True)
class MasterFragment:
    """A range of one model parameter whose fp32 master this rank owns (checkpoints).

    See Note: [checkpoint fragments] in runtime/checkpoint_state.py.
    """

    param: nn.Parameter
    """The model parameter (as in `module.named_parameters()`)."""
    param_offset: int
    """Offset (elements) of the fragment in the flattened parameter."""
    numel: int
    master: nn.Parameter
    """What the optimizer steps on for this range (`numel` fp32 elements, any shape); the key
    of its state in `optimizer.state`. Writing `master.data` then calling
    `sync_params_from_master()` sets the parameter's range."""
    values: Tensor | None = None
    """The fp32 master values when `master` holds them at lower precision (NVMe home with bf16/
    fp16: the master lives in a swap file); checkpoints save and load these instead."""


@dataclass(frozen=True, slots=True)
class ParamPiece:
    """A range of one model parameter's low-precision values this rank holds (stage 3)."""

    param: nn.Parameter
    param_offset: int
    numel: int
    data: Tensor
    """A 1-D view of the values (`numel` elements, the parameter's dtype); writable."""


class ZeroStrategy(Protocol):
    """One ZeRO stage. See Note: [step protocol] in this module's docstring.

    Subclassed explicitly by every stage, so the capability methods at the end keep their
    defaults where a stage does not override them.
    """

    @property
    def optimizer_params(self) -> list[nn.Parameter]:
        """The parameters the optimizer steps on (fp32 master weights or the model's own)."""
        ...

    def master_params_for(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """What the optimizer steps on in place of the model's `params`, on this rank.

        Stage 0: one master per parameter. Stages 1/2: the fragment of each parameter inside
        this rank's shard, skipping parameters this rank owns no part of. A frozen parameter
        (requires_grad False, e.g. in a client optimizer's group built from every parameter) is
        left out, as DeepSpeed does; any other parameter the model lacks is a ValueError.
        """
        ...

    def begin_micro_batch(self, boundary: bool) -> None: ...

    def after_backward(self) -> None: ...

    def prepare_step(self, grad_scale: float, max_norm: float) -> GradStats: ...

    def after_step(self, applied: bool) -> None: ...

    def model_state_bytes(self, optimizer_state_bytes: int) -> list[ModelStateBytes]: ...

    def transient_bytes(self) -> int:
        """Bytes held beyond the model states and kept between steps (the staging pool)."""
        ...

    def state_tensors(self) -> dict[str, list[Tensor]]:
        """The tensors holding this strategy's states, under DeepSpeed's `offload_states` names:
        "lp_params" (the low-precision values it keeps: flat buffer or shards), "hp_params"
        (master weights), "lp_grads" (gradient buffers and shards), "contiguous_grad_buffer"
        (the reducer's staging pool). Tensors of two names may share a storage (fp32 masters that
        are views of the parameters). runtime/offload_states.py moves them."""
        ...

    # -- checkpoints (runtime/checkpoint_state.py) ---------------------------------------------

    def checkpoint_fragments(self) -> list[MasterFragment]:
        """This rank's fp32 master fragments, in a fixed order (the same before save and after
        construction at load, for the same world size and config)."""
        ...

    def param_pieces(self) -> list[ParamPiece] | None:
        """The low-precision parameter pieces this rank holds, every parameter the strategy
        manages (frozen ones too); None when every rank holds whole parameters (stages 0-2)."""
        ...

    def sync_params_from_master(self) -> None:
        """After masters were overwritten (checkpoint load): make the model's parameters equal
        the masters, cast to the parameter dtype, on every rank. Collective."""
        ...

    def sync_master_from_params(self) -> None:
        """After parameters were overwritten (weights-only load): re-initialise the masters
        from them. Collective where the strategy needs it."""
        ...

    def fragment_grads(self, grad_scale: float) -> list[Tensor]:
        """The reduced gradient of each fragment of `checkpoint_fragments()` (same order), as
        new 1-D fp32 tensors: averaged over ranks and multiplied by `grad_scale` (1 / loss
        scale), before clipping. Meaningful between `after_backward()` of the micro-batch
        that ends a step and `prepare_step()`; local (no collective)."""
        ...

    def set_fragment_grad(self, index: int, value: Tensor, grad_scale: float) -> None:
        """Overwrite fragment `index`'s reduced gradient with `value` (1-D, in the units
        `fragment_grads` returns them: averaged, multiplied by `grad_scale`). Same window as
        `fragment_grads`; local (no collective)."""
        ...

    # -- capabilities, with defaults ----------------------------------------------------------

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the engine steps in place of `optimizer`. Default: `optimizer` itself;
        an NVMe optimizer home swaps its states through files (zero/offload/nvme_optim.py)."""
        return optimizer

    def parameter_offload(self) -> "ParameterOffload | None":
        """DeepSpeed's `optimizer.parameter_offload`: the handles of the hooks that gather and
        release partitioned parameters, which generation loops remove and register again
        (zero/parameter_offload.py). Default None: no stage below 3 has such hooks."""
        return None

    def keep_hooks_eager(self) -> None:
        """`engine.compile()` is about to compile the model: make the module hooks this strategy
        registered run outside the compiled graphs (Note: [hooks under torch.compile] in
        zero/stage3.py). Default: nothing to do, no stage below 3 has module hooks (the gradient
        hooks run in the autograd engine, outside any graph)."""

    def settle_step(self) -> None:
        """Finish the optimizer step still running in the background (the delayed update,
        zero/offload/delayed_step.py) and publish its weights into the model, so masters,
        optimizer state and parameters agree (checkpoints, `offload_states`). Collective where
        publishing is (every rank has the same step in flight). Default: nothing runs late."""

    def wait_step(self) -> None:
        """Wait, on this rank only, for the optimizer step running in the background: masters and
        optimizer state are then final; the model's weights still show the previous update until
        `settle_step()` (or the next step) publishes it. Local (no collective). Default: none runs."""

    def hold_for_batch(self) -> None:
        """A pipeline stage's batch begins (runtime/pipe_engine.py): stage 3 gathers every unit and
        keeps it across the batch's micro-batches. Default: nothing to hold."""

    def release_batch(self) -> None:
        """The pipeline batch ended: undo `hold_for_batch`. Default: nothing held."""

    def begin_delivered_backward(self) -> None:
        """The batch's gradients arrive in one backward that no root forward started (Note:
        [pipeline gradient capture] in pipe/schedules.py). Default: nothing to reset."""

    def keeps_local_grads(self) -> bool:
        """Whether `set_grad_reduction(False)` is supported: each rank then keeps its own
        gradient (the 1-bit optimizers all-reduce their momentum themselves). Default False:
        a sharded stage reduces gradients into shards as they arrive."""
        return False

    def reduces_at_boundary_only(self) -> bool:
        """Whether gradients accumulate whole on each rank until the step's last backward, which
        reduces their sum (stages 0 and 1). False where every backward reduces into the shards
        (stages 2 and 3: that is how they accumulate). `begin_micro_batch(True)` then
        `after_backward()` with no backward between reduces what has accumulated."""
        return False

    def set_grad_reduction(self, enabled: bool) -> None:
        """Reduce gradients over the ranks (True, always the default) or keep each rank's own
        (False; only where `keeps_local_grads()`). Takes effect from the next micro-batch."""
        if not enabled:
            raise AssertionError(f"expected keeps_local_grads() before set_grad_reduction(False), "
                                 f"got a {type(self).__name__}")
