"""ZeRO for a model with expert parameters: one strategy for the dense parameters over the
data-parallel group, one per expert group over its expert-data-parallel group, driven as one.

Note: [expert gradients] An expert's gradient on a rank already sums the contributions of every
token routed to it from the whole expert-parallel group (the all-to-all carried them there).
Its strategy sums it over the expert-data-parallel group, the ranks holding the same expert,
and divides by the whole data-parallel size (not the group's), as DeepSpeed 0.19.8 does "to
keep the gradient unaffected by ep_size": the result is the gradient of the mean over all ranks'
losses, exactly what a dense parameter gets. ZeRO 1/2 shard the expert parameters' optimizer
state over the expert-data-parallel group only. The clipping norm ("global") counts every expert
once: each expert group's squares (equal on its expert-data-parallel ranks) are summed over the
expert-parallel group and added to the dense squares (DeepSpeed's ZeRO 1/2 and bf16/fp16 norm).
DeepSpeed's fp32 ZeRO 0 clips by another number ("rank_mean"): the mean over data-parallel ranks
of each rank's norm of the dense and its own experts' gradients; zero/build.py picks that rule there.
With tensor parallelism (a norm group, Note: [norm groups] in zero/strategy.py) the dense strategy
sums its squares over the norm group itself; the experts, held whole and equal by every
tensor-parallel rank, are counted by the rank whose norm group does not list them as duplicates
(tensor-parallel rank 0), summed over the norm group once; the rule is then always "global".
Imports torch, `zeroshard.errors` and zero/strategy.py (and `zeroshard.comm`, zero/parameter_offload.py for types).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from zeroshard.errors import NotSupportedError
from zeroshard.zero.strategy import (
    GradStats,
    MasterFragment,
    ModelParallelNorm,
    ModelStateBytes,
    ParamPiece,
    ZeroStrategy,
)

if TYPE_CHECKING:
    from zeroshard.comm import Comm, ProcessGroups
    from zeroshard.zero.parameter_offload import ParameterOffload

NormRule = Literal["global", "rank_mean"]
"""How the clipping norm spans the experts (Note: [expert gradients])."""

BuildPart = Callable[[list[nn.Parameter], "Comm", "ProcessGroups"], ZeroStrategy]
"""Builds the configured stage's strategy for some parameters over one group (zero/build.py)."""


@dataclass(frozen=True, slots=True)
class ExpertPart:
    """One expert group's strategy and what turns its numbers into the global ones."""

    strategy: ZeroStrategy
    ep_comm: "Comm"
    """The expert-parallel group: its ranks hold the group's different experts."""
    grad_factor: float
    """expert-data-parallel size / data-parallel size when averaging, else 1 (Note: [expert gradients])."""
    counted: bool = True
    """False where the norm group counts these experts on another rank (a tensor-parallel rank > 0)."""


class ExpertSplitStrategy(ZeroStrategy):
    """The dense strategy and the expert groups' strategies behind the one `ZeroStrategy` the engine drives.

    Args:
        dense: the strategy of the dense parameters (over the data-parallel group).
        experts: one part per expert group.
        expert_ids: `id(param)` of each expert parameter -> its part's index in `experts`.
        norm_rule: "global" or "rank_mean" (Note: [expert gradients]).
        comm: the data-parallel group ("rank_mean" averages the ranks' norms over it).
        norm_group: the model-parallel norm group (None without tensor parallelism).
    """

    def __init__(self, dense: ZeroStrategy, experts: Sequence[ExpertPart], expert_ids: dict[int, int],
                 norm_rule: NormRule, comm: "Comm", norm_group: ModelParallelNorm | None = None) -> None:
        self._dense = dense
        self._norm_rule, self._comm, self._norm_group = norm_rule, comm, norm_group
        self._experts = list(experts)
        self._owner = {i: part + 1 for i, part in expert_ids.items()}  # index in self._parts; dense is 0
        self._parts: list[tuple[ZeroStrategy, float]] = [(dense, 1.0)] + [(e.strategy, e.grad_factor)
                                                                         for e in self._experts]

    def __repr__(self) -> str:
        return f"ExpertSplitStrategy(dense={self._dense!r}, experts={[e.strategy for e in self._experts]!r})"

    @property
    def optimizer_params(self) -> list[nn.Parameter]:
        return [p for s, _ in self._parts for p in s.optimizer_params]

    def master_params_for(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        out: list[nn.Parameter] = []
        run: list[nn.Parameter] = []
        for i, p in enumerate(params):  # runs of one owner, in order; a foreign parameter is the dense one's to refuse
            run.append(p)
            owner = self._owner.get(id(p), 0)
            if i + 1 == len(params) or self._owner.get(id(params[i + 1]), 0) != owner:
                out += self._parts[owner][0].master_params_for(run)
                run = []
        return out

    def begin_micro_batch(self, boundary: bool) -> None:
        for s, _ in self._parts:
            s.begin_micro_batch(boundary)

    def after_backward(self) -> None:
        for s, _ in self._parts:
            s.after_backward()

    def prepare_step(self, grad_scale: float, max_norm: float) -> GradStats:
        """Average and unscale every part (no clipping there), then clip all by one norm
        (Note: [expert gradients]); the parts' own norms are exact sums of squares in float64."""
        norm = self._norm(self._dense.prepare_step(grad_scale, 0.0),
                          [part.strategy.prepare_step(grad_scale * part.grad_factor, 0.0) for part in self._experts])
        if not math.isfinite(norm):
            return GradStats(norm=norm, overflow=True)
        coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
        if coef != 1.0:
            grads = [p.grad for p in self.optimizer_params if p.grad is not None]
            torch._foreach_mul_(grads, coef)
        return GradStats(norm=norm, overflow=False)

    def _norm(self, dense: GradStats, experts: list[GradStats]) -> float:
        """The clipping norm from the parts' norms (averaged, unscaled); inf anywhere -> inf on every rank."""
        def sq(stats: GradStats) -> torch.Tensor:
            return torch.tensor([stats.norm ** 2 if not stats.overflow else math.inf], dtype=torch.float64)

        total = sq(dense)
        expert_total = torch.zeros(1, dtype=torch.float64)
        for part, stats in zip(self._experts, experts):
            mine = sq(stats)
            if self._norm_rule == "global":
                part.ep_comm.all_reduce(mine)  # every expert once
            if part.counted:
                expert_total += mine
        if self._norm_group is not None:  # the dense squares were summed over it already
            self._norm_group.comm.all_reduce(expert_total)
        total += expert_total
        if self._norm_rule == "rank_mean":
            total = total.sqrt() / self._comm.world_size
            self._comm.all_reduce(total)
            return total.item()
        value = total.item()
        return math.sqrt(value) if math.isfinite(value) else math.inf

    def after_step(self, applied: bool) -> None:
        for s, _ in self._parts:
            s.after_step(applied)

    def model_state_bytes(self, optimizer_state_bytes: int) -> list[ModelStateBytes]:
        return [b for i, (s, _) in enumerate(self._parts) for b in s.model_state_bytes(optimizer_state_bytes
                                                                                         if i == 0 else 0)]

    def transient_bytes(self) -> int:
        return sum(s.transient_bytes() for s, _ in self._parts)

    def state_tensors(self) -> dict[str, list[Tensor]]:
        merged: dict[str, list[Tensor]] = {}
        for s, _ in self._parts:
            for key, tensors in s.state_tensors().items():
                merged.setdefault(key, []).extend(tensors)
        return merged

    def checkpoint_fragments(self) -> list[MasterFragment]:
        return [f for s, _ in self._parts for f in s.checkpoint_fragments()]

    def param_pieces(self) -> list[ParamPiece] | None:
        pieces = [s.param_pieces() for s, _ in self._parts]
        return None if all(p is None for p in pieces) else [x for p in pieces for x in p or []]

    def sync_params_from_master(self) -> None:
        for s, _ in self._parts:
            s.sync_params_from_master()

    def sync_master_from_params(self) -> None:
        for s, _ in self._parts:
            s.sync_master_from_params()

    def fragment_grads(self, grad_scale: float) -> list[Tensor]:
        return [g for s, f in self._parts for g in s.fragment_grads(grad_scale * f)]

    def set_fragment_grad(self, index: int, value: Tensor, grad_scale: float) -> None:
        for s, f in self._parts:
            count = len(s.checkpoint_fragments())
            if index < count:
                s.set_fragment_grad(index, value, grad_scale * f)
                return
            index -= count
        raise IndexError(f"fragment index past the last fragment ({len(self.checkpoint_fragments())})")

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """`optimizer` itself: the parts share it, and a part's own wrapper (an NVMe home's swap,
        ZenFlow's step, the delayed update) would step it alone. zero/build.py refuses those
        settings by name at initialize; a part that still wraps is an error here, never dropped."""
        for part, _ in self._parts:
            wrapped = part.wrap_optimizer(optimizer)
            if wrapped is not optimizer:
                raise NotSupportedError(f"{type(wrapped).__name__} around the optimizer of one expert-split part is "
                                        "not implemented beside MoE layers; zero/build.py should have refused its "
                                        "setting by name")
        return optimizer

    def parameter_offload(self) -> "ParameterOffload | None":
        return None

    def keep_hooks_eager(self) -> None:
        self._each("keep_hooks_eager")

    def hold_for_batch(self) -> None:
        self._each("hold_for_batch")

    def release_batch(self) -> None:
        self._each("release_batch")

    def begin_delivered_backward(self) -> None:
        self._each("begin_delivered_backward")

    def keeps_local_grads(self) -> bool:
        return self._dense.keeps_local_grads()

    def reduces_at_boundary_only(self) -> bool:
        return self._dense.reduces_at_boundary_only()

    def set_grad_reduction(self, enabled: bool) -> None:
        self._each("set_grad_reduction", enabled)

    def _each(self, method: str, *args: Any) -> None:
        """The same protocol call on the dense strategy and every expert group's."""
        for s, _ in self._parts:
            getattr(s, method)(*args)


def build_expert_split(dense_params: list[nn.Parameter], expert_groups: Sequence[tuple[list[nn.Parameter],
                       "Comm", "ProcessGroups", "Comm"]], build: BuildPart, comm: "Comm",
                       groups: "ProcessGroups", average: bool, norm_rule: NormRule,
                       norm_group: ModelParallelNorm | None = None) -> ExpertSplitStrategy:
    """The split strategy: `build` over the dense parameters and the data-parallel group, and over
    each expert group's parameters and its (edp_comm, edp_groups), with its ep_comm for the norm."""
    dense = build(dense_params, comm, groups)
    dup = norm_group.duplicates if norm_group is not None else frozenset()
    parts = [ExpertPart(build(params, edp_comm, edp), ep_comm, edp.world_size / groups.world_size if average else 1.0,
                        counted=not any(id(p) in dup for p in params))
             for params, edp_comm, edp, ep_comm in expert_groups]
    ids = {id(p): i for i, (params, *_) in enumerate(expert_groups) for p in params}
    return ExpertSplitStrategy(dense, parts, ids, norm_rule, comm, norm_group)
