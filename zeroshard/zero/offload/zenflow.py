"""DeepSpeed's ZenFlow update rule over one rank's optimizer shard (ZeRO stages 1-3, CPU offload).

`ZenFlowStep` is the optimizer the engine steps when `zero_optimization.zenflow` is on: it wraps
the CPU torch Adam/AdamW over the shard's fragments (zero/shard.py) and adds the selective
update of the top-k gradient columns on the model's device. Imports torch, `errors`,
zenflow_state.py, zenflow_overlap.py and (for typing) the `config` section; the shard gives it
the fragments, their views in the model's values (the flat buffer at stages 1-2, the rank's
parameter shard at stage 3) and a sum all-reduce.

Note: [zenflow rule] Read from DeepSpeed 0.19.8 (runtime/zenflow/engine.py,
zenflow_stage_1_and_2.py, ops/adam/zenflow_torch_adam.py, zenflow_cpu_adam.py), with
overlap_step false (true changes only the CPU step: Note: [zenflow overlap] in
zenflow_overlap.py). Steps k = 0, 1, ... are optimizer steps; U = update_interval, S =
select_interval in steps (ZenFlowConfig.select_steps: "epoch" multiplies it by the epoch's steps,
"auto" is one epoch, and without an epoch length S = 0); W = full_warm_up_rounds; g_k is step k's
reduced, averaged gradient divided by U (DeepSpeed sets gradient_accumulation_steps to U, so its
loss is divided by U every step). update_interval "auto" changes the CPU step's schedule and
scaling: Note: [zenflow auto update] in zenflow_state.py.
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
  In bf16 runs the values, g_k's selected elements and the moments are bf16, as in DeepSpeed;
  the step count is fp32 (DeepSpeed's is bf16, which stops at 256).
zeroshard differs in where the selection is made: over each weight's whole columns, the norms
summed across the ranks in one all-reduce, so the selection does not depend on the rank count
(DeepSpeed selects within each rank's partition, skipping the columns cut by its boundary); and
each rank applies the selective step to the elements of its own shard, which the all-gather that
ends every step spreads (DeepSpeed broadcasts the selected gradients and every rank updates all
of them). At stage 3 the same rule runs on the rank's parameter shard, which the next forward
gathers (DeepSpeed 0.19.8's runtime/zenflow/engine_stage3.py: the rule is the same; it stores
each 2-D weight transposed, picks the global top-k over the columns lying whole inside a rank's
partition from all-gathered column sums, and each rank steps its own columns).

Note: [zenflow clip] With `gradient_clipping` c > 0 each of the two optimizers steps with its
gradient times min(1, c / (norm + 1e-6)) (the engine's factor), once, where the norm is the
global L2 norm of a whole gradient (every element of every parameter, squares summed across the
ranks in float64: Note: [norm rounding] in zero/strategy.py):
- the CPU step: the gradient it is given (acc, or its mean with update_interval "auto"), by that
  gradient's own norm, as DeepSpeed 0.19.8 does (its ZeRO step takes the norm of the gradient
  accumulated since the last CPU step and clips it before the CPU optimizer steps);
- the selective step: g_k's selected elements, by the norm of the step's whole averaged gradient
  (g_k before the division by U: the norm engine.get_global_grad_norm() reports), the factor
  the same step gets without ZenFlow. DeepSpeed does not clip them: its selective AdamW steps
  on the raw gradient during the backward, before any norm is known, so clipping never reached
  the columns with the largest gradients (docs/deepspeed-differences.md, ZenFlow).
Both norms are in the units of an averaged gradient (acc sums G_j / U over at most U steps), so
c means what it means without ZenFlow. The selection, the adaptive interval's sums and the
accumulator read the unclipped g_k, as in DeepSpeed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim.adamw import adamw

from zeroshard.errors import NotSupportedError
from zeroshard.zero.offload.zenflow_overlap import OverlappedCpuStep
from zeroshard.zero.offload.zenflow_state import GLOBAL, KEYS, AutoUpdate, ZenFlowPiece, export_piece, import_piece

if TYPE_CHECKING:
    from zeroshard.config.schema_zero import ZenFlowConfig


@dataclass(frozen=True, slots=True)
class ZenFlowRule:
    """When ZenFlow selects columns and steps the CPU optimizer (Note: [zenflow rule])."""

    topk_ratio: float
    select_interval: int
    """Steps between selections; 0: select once, at step `warmup`."""
    update_interval: int | None
    """Steps between CPU steps; None: "auto" (Note: [zenflow auto update])."""
    warmup: int
    """`full_warm_up_rounds`: steps with a CPU step every step and no selection."""
    auto_ratio: float = 0.99
    overlap: bool = False
    """`overlap_step`: the CPU step on a worker thread, one CPU step late (Note: [zenflow overlap])."""

    @classmethod
    def from_config(cls, section: "ZenFlowConfig") -> "ZenFlowRule | None":
        if not section.enabled:
            return None
        update = None if isinstance(section.update_interval, str) else int(section.update_interval)
        return cls(topk_ratio=float(section.topk_ratio), select_interval=section.select_steps, update_interval=update,
                   warmup=int(section.full_warm_up_rounds), auto_ratio=float(section.auto_ratio),
                   overlap=bool(section.overlap_step))

    def selects(self, k: int) -> bool:
        """Step k (from 0) selects new columns."""
        return k >= self.warmup and (k == self.warmup or (self.select_interval > 0 and k % self.select_interval == 0))

    def cpu_steps(self, k: int, fire: bool = False) -> bool:
        """Step k ends with the CPU optimizer's step on the accumulated gradient (`fire`: the
        adaptive interval's call, Note: [zenflow auto update])."""
        if k + 1 <= self.warmup:
            return True
        due = fire if self.update_interval is None else (k + 1 - self.warmup) % self.update_interval == 0
        return due or (self.select_interval > 0 and (k + 1) % self.select_interval == 0)

    def moment_set(self, k: int) -> int:
        """Which of the overlapped CPU step's two moment sets step k uses (Note: [zenflow overlap])."""
        if k < self.warmup:
            return k & 1
        return (k + 1) & 1 if self.update_interval is None else (k // self.update_interval) & 1

    @property
    def grad_divisor(self) -> int:
        """g_k is the averaged gradient divided by this (DeepSpeed's loss / gradient_accumulation_steps)."""
        return self.update_interval or 1

    def num_selected(self, columns: int) -> int:
        return max(1, int(columns * self.topk_ratio))


class ZenFlowStep(torch.optim.Optimizer):
    """Steps `inner` (torch Adam / AdamW over the fragments) by ZenFlow's rule (Note: [zenflow rule]).

    `param_groups`, `state` and `defaults` are `inner`'s own objects (an lr scheduler built on
    either sees the same groups).

    Args:
        inner: the CPU torch Adam or AdamW over the shard's fragments.
        pieces: the shard's fragments with their views in the model's values.
        shapes: every model parameter's shape, in plan order (the same on every rank).
        rule: the intervals and ratio.
        all_reduce: sums a 1-D fp32 / float64 tensor on `device` over the data-parallel ranks, in place.
        device: the model's device (the selective step and the column norms run there).
        world_size: the data-parallel ranks (a checkpoint resumes at the world size it was saved at).
        squares: the global sum of squares of one tensor per piece (pieces' order), counted as the
            gradient norm is: the CPU step's clip norm (Note: [zenflow clip]).
    """

    def __init__(self, inner: torch.optim.Optimizer, pieces: Sequence[ZenFlowPiece], shapes: Sequence[torch.Size],
                 rule: ZenFlowRule, all_reduce: Callable[[Tensor], None], device: torch.device,
                 world_size: int = 1, squares: Callable[[Sequence[Tensor]], float] | None = None) -> None:
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
        self._squares = squares
        self._max_norm, self._step_norm = 0.0, 0.0
        self._world_size = world_size
        self._pieces = list(pieces)
        self._shapes = [torch.Size(s) for s in shapes]
        self._group_of = {id(p): g for g in inner.param_groups for p in g["params"]}
        offsets, total = {}, 0
        for i, s in enumerate(self._shapes):
            if len(s) == 2:
                offsets[i], total = total, total + s[1]
        self._norm_offset, self._norm_numel = offsets, total
        self._weight_index = {i: w for w, i in enumerate(offsets)}  # 2-D parameter -> its row in AutoUpdate
        self._auto = (AutoUpdate.zeros(rule.topk_ratio, rule.auto_ratio, len(offsets), device)
                      if rule.update_interval is None else None)
        self.steps = 0
        """Steps taken (`step()` calls), k of the rule for the next one."""
        self._acc_steps = 0
        """Steps accumulated into the pieces' `acc` since the last CPU step."""
        self._overlap = OverlappedCpuStep(self._pieces) if rule.overlap else None

    # -- the wrapped optimizer's objects ------------------------------------------------------

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.inner.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        """inner's state, each fragment's with ZenFlow's beside it (zenflow_state.py's keys)."""
        return _ZenFlowStateView(self)

    @state.setter
    def state(self, state: Any) -> None:
        self.inner.state = state

    @property
    def resident_state_bytes(self) -> int:
        """The CPU optimizer's states, the accumulated gradients and the selective AdamW's states."""
        tensors = [v for s in self.inner.state.values() for v in s.values() if isinstance(v, Tensor) and v.dim() > 0]
        tensors += [t for p in self._pieces for t in (p.acc, p.exp_avg, p.exp_avg_sq) if t is not None]
        overlap = self._overlap.state_bytes if self._overlap is not None else 0
        return sum(t.numel() * t.element_size() for t in tensors) + overlap

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def drain(self) -> None:
        """Finish the overlapped CPU step in flight (its result stays pending, Note: [zenflow
        overlap]): before a checkpoint reads the masters or a load writes them."""
        if self._overlap is not None:
            self._overlap.wait()

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """inner's, with each fragment's ZenFlow state added to its entry (`state`'s view)."""
        self.drain()
        out = self.inner.state_dict()
        index = {id(p): i for i, p in enumerate(p for g in self.inner.param_groups for p in g["params"])}
        for piece in self._pieces:
            out["state"].setdefault(index[id(piece.master)], {}).update(self._export(piece))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """`state_dict()`'s layout: ZenFlow's keys go to the pieces, the rest to inner."""
        masters = [p for g in self.inner.param_groups for p in g["params"]]
        own: dict[int, dict[str, Any]] = {}
        inner_state: dict[int, dict[str, Any]] = {}
        for i, entry in state_dict["state"].items():
            own[id(masters[int(i)])] = {k: v for k, v in entry.items() if k in KEYS}
            rest = {k: v for k, v in entry.items() if k not in KEYS}
            if rest:
                inner_state[i] = rest
        self.check_loadable([own.get(id(p.master), {}) for p in self._pieces])
        self.drain()
        self.inner.load_state_dict({**state_dict, "state": inner_state})
        for piece in self._pieces:
            import_piece(piece, own[id(piece.master)])
        if self._overlap is not None:
            self._overlap.load([own[id(p.master)] for p in self._pieces])
        if self._pieces:
            shared = own[id(self._pieces[0].master)][GLOBAL]
            self.steps, self._acc_steps = int(shared["steps"]), int(shared["acc_steps"])
            if self._auto is not None:
                self._auto.load(shared["auto"])

    def check_loadable(self, states: Sequence[dict[str, Any]]) -> None:
        """Raise unless `states` (this rank's fragments' loaded states) resume this ZenFlow: checked
        before a load changes anything (Note: [no partial load] in checkpoint/load.py)."""
        missing = sum(GLOBAL not in s for s in states)
        if missing:
            raise NotSupportedError("zero_optimization.zenflow: the checkpoint holds no ZenFlow state for "
                                    f"{missing} of this rank's fragments (saved without zenflow?); resuming "
                                    "ZenFlow from such a checkpoint is not implemented. Load it without zenflow, "
                                    "or with load_optimizer_states=False (ZenFlow then starts afresh).")
        saved_overlap = {bool(s[GLOBAL].get("overlap", False)) for s in states}
        if saved_overlap - {self._rule.overlap}:
            raise NotSupportedError(f"zero_optimization.zenflow: the checkpoint was saved with overlap_step "
                                    f"{str(not self._rule.overlap).lower()}, this run has "
                                    f"{str(self._rule.overlap).lower()}: resuming across it is not implemented (the "
                                    "CPU step's moments are kept differently). Resume with the saved overlap_step, or "
                                    "load with load_optimizer_states=False (ZenFlow then starts afresh).")
        saved_world = {int(s[GLOBAL]["world_size"]) for s in states}
        if saved_world - {self._world_size}:
            raise NotSupportedError(f"zero_optimization.zenflow: resuming ZenFlow's state saved by {min(saved_world)} "
                                    f"data-parallel ranks on {self._world_size}: not implemented (not checked across "
                                    "world sizes). Resume at the saved world size, or load with "
                                    "load_optimizer_states=False (ZenFlow then starts afresh from the loaded weights).")

    def _export(self, piece: ZenFlowPiece) -> dict[str, Any]:
        shared = {"steps": self.steps, "acc_steps": self._acc_steps, "world_size": self._world_size,
                  "auto": self._auto.to_state() if self._auto is not None else None, "overlap": self._rule.overlap}
        out = export_piece(piece, shared)
        if self._overlap is not None:
            self._overlap.wait()
            out.update(self._overlap.export(next(i for i, p in enumerate(self._pieces) if p is piece)))
        return out

    def set_clip(self, max_norm: float, step_norm: float) -> None:
        """Before each step: `gradient_clipping` (0: none) and the norm of the step's averaged
        gradient (the shard's `prepare_step` computes it and leaves the gradients unclipped)."""
        self._max_norm, self._step_norm = max_norm, step_norm

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
        grads = [p.master.grad.float() / rule.grad_divisor for p in self._pieces]  # 1D fp32
        fire = self._auto.begin_step() if self._auto is not None else False
        if rule.selects(k):
            self.drain()  # the master is refreshed from the model: the step in flight must be done
            self._select(k, grads)
        if self._auto is not None and k >= rule.warmup:
            self._observe(grads)
        for piece, g in zip(self._pieces, grads):
            piece.acc.add_(g)
        self._acc_steps += 1
        if rule.cpu_steps(k, fire):
            if self._overlap is None:
                self._cpu_step(k)
            else:
                self._overlapped_cpu_step(k, self._overlap)
        if k >= rule.warmup:
            self._selective_step(grads, self._clip_factor(self._step_norm))
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

    def _observe(self, grads: Sequence[Tensor]) -> None:
        """The adaptive interval's sums of |g| per 2-D weight, whole and over the selected columns,
        summed across the ranks in float64 (Note: [zenflow auto update])."""
        if self._auto is None:
            raise AssertionError("expected update_interval \"auto\"")
        weights = len(self._weight_index)
        sums = torch.zeros(2 * weights, dtype=torch.float64, device=self._device)
        for piece, g in zip(self._pieces, grads):
            if piece.columns is None or piece.selected is None:
                continue
            w = self._weight_index[piece.param_index]
            a = g.to(self._device, torch.float64).abs()
            sums[w] += a.sum()
            sums[weights + w] += a[piece.selected].sum()
        self._all_reduce(sums)
        self._auto.observe(sums[:weights], sums[weights:])

    def _clip_factor(self, norm: float) -> float:
        """The engine's clip factor (unscale_and_clip in zero/strategy.py) for a gradient of global
        norm `norm`; 1.0 without clipping (Note: [zenflow clip])."""
        return min(1.0, self._max_norm / (norm + 1e-6)) if self._max_norm > 0 else 1.0

    def _accumulated_norm(self, accumulated: Sequence[Tensor]) -> float:
        if self._max_norm <= 0:
            return 0.0  # not read
        if self._squares is None:
            raise AssertionError("expected a sum of squares over the ranks to clip ZenFlow's CPU step")
        return math.sqrt(self._squares(accumulated))

    def _cpu_step_grads(self) -> list[Tensor]:
        """The CPU step's gradient: the accumulated one (its mean with update_interval "auto"),
        clipped by its own norm (Note: [zenflow clip])."""
        mean = self._rule.update_interval is None and self._acc_steps != 1
        accumulated = [piece.acc / self._acc_steps if mean else piece.acc for piece in self._pieces]
        coef = self._clip_factor(self._accumulated_norm(accumulated))
        return [acc * coef if coef != 1.0 else acc for acc in accumulated]

    def _publish(self, values: Sequence[Tensor]) -> None:
        """Cast master values (one 1-D tensor per piece) into the model's values, except the
        selected elements, which keep theirs."""
        for piece, new in zip(self._pieces, values):
            kept = piece.lp[piece.selected].clone() if piece.selected is not None else None
            piece.lp.copy_(new)
            if kept is not None:
                piece.lp[piece.selected] = kept

    def _overlapped_cpu_step(self, k: int, overlap: OverlappedCpuStep) -> None:
        """Note: [zenflow overlap]: the previous CPU step's result into the model, this one started
        on the worker thread (and waited for during the warm-up)."""
        pending = overlap.take()
        if pending is not None:
            self._publish(pending)
        grads = self._cpu_step_grads()
        for piece in self._pieces:  # the thread owns the old accumulators (or their clipped copies)
            piece.acc = torch.zeros_like(piece.acc)
        overlap.submit(k, grads, [self._group_of[id(p.master)] for p in self._pieces], self._rule.moment_set(k))
        if k < self._rule.warmup:
            done = overlap.take()
            if done is None:
                raise AssertionError("expected the warm-up's CPU step to have a result")
            self._publish(done)
        self._acc_steps = 0

    def _cpu_step(self, k: int) -> None:
        """The CPU optimizer on `_cpu_step_grads()`, step count k + 1; published into the model's
        values except the selected elements."""
        for piece, grad in zip(self._pieces, self._cpu_step_grads()):
            piece.master.grad = grad
            state = self.inner.state[piece.master]
            if not state:
                state["exp_avg"] = torch.zeros_like(piece.master)
                state["exp_avg_sq"] = torch.zeros_like(piece.master)
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["step"].fill_(float(k))  # torch's Adam adds one: DeepSpeed's step_id = micro_step + 1
        self.inner.step()
        self._publish([p.master for p in self._pieces])
        for piece in self._pieces:
            piece.acc.zero_()
            piece.master.grad = None
        self._acc_steps = 0

    def _selective_step(self, grads: Sequence[Tensor], coef: float) -> None:
        """AdamW on the selected elements of the model's values (DeepSpeed's ZenFlowSelectiveAdamW),
        their gradient times `coef` (the step's clip factor)."""
        for piece, g in zip(self._pieces, grads):
            if piece.selected is None or piece.exp_avg is None or piece.exp_avg_sq is None:
                raise AssertionError("expected a selection before the first selective step")
            group = self._group_of[id(piece.master)]
            values = piece.lp[piece.selected]
            beta1, beta2 = group["betas"]
            selected = g.to(piece.lp.device)[piece.selected]
            selected = selected * coef if coef != 1.0 else selected
            adamw([values], [selected.to(values.dtype)], [piece.exp_avg],
                  [piece.exp_avg_sq], [], [piece.step], foreach=False, amsgrad=False, beta1=beta1, beta2=beta2,
                  lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
            piece.lp[piece.selected] = values


class _ZenFlowStateView(Mapping[Tensor, dict[str, Any]]):
    """`ZenFlowStep.state`: fragment -> inner's state with ZenFlow's beside it, built on each read
    (the checkpoint's collector reads fragments' states here: runtime/checkpoint_state.py)."""

    def __init__(self, owner: ZenFlowStep) -> None:
        self._owner = owner
        self._pieces = {id(p.master): p for p in owner._pieces}

    def __getitem__(self, p: Tensor) -> dict[str, Any]:
        piece = self._pieces.get(id(p))
        if piece is None:
            return self._owner.inner.state[p]
        return {**self._owner.inner.state.get(p, {}), **self._owner._export(piece)}

    def __contains__(self, p: object) -> bool:
        return id(p) in self._pieces or p in self._owner.inner.state

    def __iter__(self) -> Iterator[Tensor]:
        return iter([p.master for p in self._owner._pieces])

    def __len__(self) -> int:
        return len(self._pieces)
