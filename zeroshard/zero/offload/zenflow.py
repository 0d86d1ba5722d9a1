"""DeepSpeed's ZenFlow update rule over one rank's optimizer shard (stages 1 and 2, CPU offload).

`ZenFlowStep` is the optimizer the engine steps when `zero_optimization.zenflow` is on: it wraps
the CPU torch Adam/AdamW over the shard's fragments (zero/shard.py) and adds the selective
update of the top-k gradient columns on the model's device. Imports torch, `errors` and (for
typing) the `config` section; the shard gives it the fragments, their views in the model's flat
buffer and a sum all-reduce.

Note: [zenflow rule] Read from DeepSpeed 0.19.8 (runtime/zenflow/engine.py,
zenflow_stage_1_and_2.py, ops/adam/zenflow_torch_adam.py, zenflow_cpu_adam.py), with
overlap_step false and select_strategy "step". Steps k = 0, 1, ... are optimizer steps; U =
update_interval, S = select_interval, W = full_warm_up_rounds; g_k is step k's reduced, averaged
gradient divided by U (DeepSpeed sets gradient_accumulation_steps to U, so its loss is divided
by U every step).
- Selection, at k = W and at every k > W with S > 0 and k % S == 0: for each 2-D weight, the
  max(1, int(columns * topk_ratio)) columns (dim 1) with the largest L1 norm of g_k over dim 0;
  every 1-D parameter is selected whole. Before it (k > 0) the fp32 master is set from the
  model's values and the selective AdamW's exp_avg / exp_avg_sq are zeroed (its step count is
  kept).
- Every step: acc += g_k.
- CPU step, at every k < W and where (k + 1 - W) % U == 0 or (S > 0 and (k + 1) % S == 0): the
  CPU optimizer steps the fp32 master on acc with step count k + 1 (DeepSpeed's step_id is the
  micro step, not the number of CPU steps), the master is cast into the model's values except
  the selected elements, which keep theirs, and acc is zeroed.
- Selective step, at every k >= W (after the CPU step when both happen): AdamW on the selected
  elements of the model's values with g_k's selected elements, the hyper-parameters of the
  element's optimizer group (DeepSpeed's ZenFlowSelectiveAdamW, always decoupled weight decay).
zeroshard differs in where the selection is made: over each weight's whole columns, the norms
summed across the ranks in one all-reduce, so the selection does not depend on the rank count
(DeepSpeed selects within each rank's partition, skipping the columns cut by its boundary); and
each rank applies the selective step to the elements of its own shard, which the all-gather that
ends every step spreads (DeepSpeed broadcasts the selected gradients and every rank updates all
of them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.optim.adamw import adamw

from zeroshard.errors import NotSupportedError

if TYPE_CHECKING:
    from zeroshard.config.schema_zero import ZenFlowConfig


@dataclass(frozen=True, slots=True)
class ZenFlowRule:
    """When ZenFlow selects columns and steps the CPU optimizer (Note: [zenflow rule])."""

    topk_ratio: float
    select_interval: int
    """Steps between selections; 0: select once, at step `warmup`."""
    update_interval: int
    warmup: int
    """`full_warm_up_rounds`: steps with a CPU step every step and no selection."""

    @classmethod
    def from_config(cls, section: "ZenFlowConfig") -> "ZenFlowRule | None":
        if not section.enabled:
            return None
        if section.select_strategy != "step":
            raise AssertionError("expected config/load.py::check_zenflow to refuse the select_strategy "
                                 f"{section.select_strategy!r}")
        return cls(topk_ratio=float(section.topk_ratio), select_interval=int(section.select_interval),
                   update_interval=int(section.update_interval), warmup=int(section.full_warm_up_rounds))

    def selects(self, k: int) -> bool:
        """Step k (from 0) selects new columns."""
        return k >= self.warmup and (k == self.warmup or (self.select_interval > 0 and k % self.select_interval == 0))

    def cpu_steps(self, k: int) -> bool:
        """Step k ends with the CPU optimizer's step on the accumulated gradient."""
        if k + 1 < self.warmup:
            return True
        return ((k + 1 - self.warmup) % self.update_interval == 0
                or (self.select_interval > 0 and (k + 1) % self.select_interval == 0))

    def num_selected(self, columns: int) -> int:
        return max(1, int(columns * self.topk_ratio))


@dataclass(slots=True)
class ZenFlowPiece:
    """One fragment of the shard as ZenFlow sees it."""

    master: nn.Parameter
    """The fragment: 1-D fp32 master values at the optimizer's home."""
    lp: Tensor
    """1-D view of the same elements in the model's values (the flat buffer)."""
    param_index: int
    columns: Tensor | None
    """1-D int64 on the model's device, the column (dim 1) of each element of a 2-D weight; None
    for 1-D parameters."""
    acc: Tensor = field(init=False)
    """1-D fp32, the gradient accumulated since the last CPU step (at the master's home)."""
    selected: Tensor | None = None
    """1-D int64 positions inside the piece updated by the selective step (None: not yet)."""
    exp_avg: Tensor | None = None
    exp_avg_sq: Tensor | None = None
    step: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float32))

    def __post_init__(self) -> None:
        self.acc = torch.zeros(self.master.numel(), dtype=torch.float32, device=self.master.device)


class ZenFlowStep(torch.optim.Optimizer):
    """Steps `inner` (torch Adam / AdamW over the fragments) by ZenFlow's rule (Note: [zenflow rule]).

    `param_groups`, `state` and `defaults` are `inner`'s own objects (an lr scheduler built on
    either sees the same groups).

    Args:
        inner: the CPU torch Adam or AdamW over the shard's fragments.
        pieces: the shard's fragments with their views in the model's values.
        shapes: every model parameter's shape, in plan order (the same on every rank).
        rule: the intervals and ratio.
        all_reduce: sums a 1-D fp32 tensor on `device` over the data-parallel ranks, in place.
        device: the model's device (the selective step and the column norms run there).
    """

    def __init__(self, inner: torch.optim.Optimizer, pieces: Sequence[ZenFlowPiece], shapes: Sequence[torch.Size],
                 rule: ZenFlowRule, all_reduce: Callable[[Tensor], None], device: torch.device) -> None:
        # torch.optim.Optimizer.__init__ is not called: groups and state stay inner's objects.
        if not isinstance(inner, torch.optim.Adam):  # torch's AdamW subclasses Adam
            raise NotSupportedError(f"zero_optimization.zenflow steps Adam or AdamW; got {type(inner).__name__}. "
                                    'Use optimizer type "Adam" or "AdamW", or remove zero_optimization.zenflow.')
        if any(g.get("amsgrad") for g in inner.param_groups):
            raise NotSupportedError("zero_optimization.zenflow with amsgrad: not implemented (the selective step "
                                    "keeps no max_exp_avg_sq); set amsgrad to false.")
        if any(len(s) > 2 for s in shapes):
            bad = [tuple(s) for s in shapes if len(s) > 2]
            raise NotSupportedError(f"zero_optimization.zenflow selects columns of 1-D and 2-D parameters only "
                                    f"(as DeepSpeed does); the model has parameters of shapes {bad[:3]}.")
        self.inner, self._rule, self._all_reduce, self._device = inner, rule, all_reduce, device
        self._pieces = list(pieces)
        self._shapes = [torch.Size(s) for s in shapes]
        self._group_of = {id(p): g for g in inner.param_groups for p in g["params"]}
        offsets, total = {}, 0
        for i, s in enumerate(self._shapes):
            if len(s) == 2:
                offsets[i], total = total, total + s[1]
        self._norm_offset, self._norm_numel = offsets, total
        self.steps = 0
        """Steps taken (`step()` calls), k of the rule for the next one."""

    # -- the wrapped optimizer's objects ------------------------------------------------------

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.inner.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, state: Any) -> None:
        self.inner.state = state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        raise NotImplementedError("saving a checkpoint with zero_optimization.zenflow is not implemented (the "
                                  "accumulated gradient and the selective AdamW state are not saved)")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        raise NotImplementedError("loading a checkpoint with zero_optimization.zenflow is not implemented")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("add_param_group on a ZeRO engine's optimizer: build every group before "
                                  "zeroshard.initialize()")

    def __repr__(self) -> str:
        return f"ZenFlowStep({self.inner!r}, {self._rule})"

    # -- the step ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise NotImplementedError("zero_optimization.zenflow: step without a closure")
        k, rule = self.steps, self._rule
        grads = [p.master.grad.float() / rule.update_interval for p in self._pieces]  # 1D fp32
        if rule.selects(k):
            self._select(k, grads)
        for piece, g in zip(self._pieces, grads):
            piece.acc.add_(g)
        if rule.cpu_steps(k):
            self._cpu_step(k)
        if k >= rule.warmup:
            self._selective_step(grads)
        self.steps += 1
        return None

    def _select(self, k: int, grads: Sequence[Tensor]) -> None:
        """New top-k columns from this step's gradient (Note: [zenflow rule])."""
        norms = torch.zeros(self._norm_numel, dtype=torch.float32, device=self._device)
        for piece, g in zip(self._pieces, grads):
            if piece.columns is not None:
                off = self._norm_offset[piece.param_index]
                norms.index_add_(0, piece.columns + off, g.abs().to(self._device))
        self._all_reduce(norms)
        chosen: dict[int, Tensor] = {}
        for i, off in self._norm_offset.items():
            columns = self._shapes[i][1]
            top = torch.topk(norms[off : off + columns], self._rule.num_selected(columns)).indices
            chosen[i] = top.sort().values
        for piece in self._pieces:
            if k > 0:
                piece.master.copy_(piece.lp)  # DeepSpeed's sync_fp32_param_from_gpu
            if piece.columns is None:
                piece.selected = torch.arange(piece.lp.numel(), device=piece.lp.device)
            else:
                hit = torch.isin(piece.columns, chosen[piece.param_index])
                piece.selected = hit.nonzero().squeeze(1)
            n = piece.selected.numel()
            piece.exp_avg = torch.zeros(n, dtype=piece.lp.dtype, device=piece.lp.device)
            piece.exp_avg_sq = torch.zeros(n, dtype=piece.lp.dtype, device=piece.lp.device)

    def _cpu_step(self, k: int) -> None:
        """The CPU optimizer on the accumulated gradient, step count k + 1; published into the
        model's values except the selected elements."""
        for piece in self._pieces:
            piece.master.grad = piece.acc
            state = self.inner.state[piece.master]
            if not state:
                state["exp_avg"] = torch.zeros_like(piece.master)
                state["exp_avg_sq"] = torch.zeros_like(piece.master)
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["step"].fill_(float(k))  # torch's Adam adds one: DeepSpeed's step_id = micro_step + 1
        kept = [p.lp[p.selected].clone() if p.selected is not None else None for p in self._pieces]
        self.inner.step()
        for piece, values in zip(self._pieces, kept):
            piece.lp.copy_(piece.master)
            if values is not None:
                piece.lp[piece.selected] = values
            piece.acc.zero_()
            piece.master.grad = None

    def _selective_step(self, grads: Sequence[Tensor]) -> None:
        """AdamW on the selected elements of the model's values (DeepSpeed's ZenFlowSelectiveAdamW)."""
        for piece, g in zip(self._pieces, grads):
            if piece.selected is None or piece.exp_avg is None or piece.exp_avg_sq is None:
                raise AssertionError("expected a selection before the first selective step")
            group = self._group_of[id(piece.master)]
            values = piece.lp[piece.selected]
            beta1, beta2 = group["betas"]
            adamw([values], [g.to(piece.lp.device)[piece.selected].to(values.dtype)], [piece.exp_avg],
                  [piece.exp_avg_sq], [], [piece.step], foreach=False, amsgrad=False, beta1=beta1, beta2=beta2,
                  lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
            piece.lp[piece.selected] = values
