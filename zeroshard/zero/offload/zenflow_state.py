"""ZenFlow's state beyond the CPU optimizer's: each fragment's (`ZenFlowPiece`), the adaptive update
interval's (`AutoUpdate`), and the values a checkpoint saves of them (`export_piece` /
`import_piece`). Imports torch only.

Note: [zenflow auto update] `update_interval: "auto"`, read from DeepSpeed 0.19.8
(zenflow_stage_1_and_2.py: backward_prologue, _process_selected_fp32_groups_grad; runtime/
zenflow/engine.py: is_zenflow_update_boundary; runtime/engine.py: _backward_prologue). State:
an interval count n, a pending flag, and per 2-D weight w two sums, avg_critic[w] and
non_critic[w], all zero at the start. At step k (from 0), in this order:
- Start: fire = pending; pending = false; when fire, n = 0 and every non_critic = 0; n += 1.
- After the selection (Note: [zenflow rule]), at k >= full_warm_up_rounds: for each 2-D weight,
  T = sum |g_k| over the weight, C = the same over its selected columns, r = topk_ratio;
  avg_critic = (avg_critic * (n - 1) + C) / n / (10 r); non_critic += (T - C) / (10 (1 - r)).
  pending = (the weights with non_critic >= avg_critic) >= int(auto_ratio * number of 2-D weights).
- The CPU step ends step k when k < full_warm_up_rounds, or fire, or select_interval > 0 and
  (k + 1) % select_interval == 0.
So the decision made from step k's gradient makes step k + 1 a CPU step, as DeepSpeed's two
`zenflow_need_update` flags (one written during a step, the other read at its boundary) are
meant to. DeepSpeed 0.19.8 clears the flag written at step k at the start of step k + 1, before
its boundary reads it (the optimizer's backward_prologue runs before the engine flips
`zenflow_state`), so its adaptive CPU step never happens at stages 1-2; zeroshard reads the flag
as the double buffer intends. DeepSpeed also sets gradient_accumulation_steps to the update
interval, 0 for "auto", and divides every gradient by it; zeroshard defines the gradient as not
divided (g_k above, the selection and the selective step), and the CPU step's gradient as the mean
of the gradients accumulated since the last CPU step (what a fixed interval U gives: the sum of
g_k / U over U steps). T and C are summed over whole weights across the ranks in float64
(DeepSpeed sums each rank's partition in bf16 and broadcasts), so every rank decides alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

ACC, SELECTED, EXP_AVG, EXP_AVG_SQ, STEP, GLOBAL = (
    "zenflow_acc", "zenflow_selected", "zenflow_exp_avg", "zenflow_exp_avg_sq", "zenflow_step", "zenflow")
"""Keys of ZenFlow's state beside the CPU optimizer's, in each fragment's optimizer state."""
CPU_MOMENTS = ("zenflow_cpu_exp_avg0", "zenflow_cpu_exp_avg1", "zenflow_cpu_exp_avg_sq0", "zenflow_cpu_exp_avg_sq1")
"""`overlap_step`: the overlapped CPU step's two moment sets (Note: [zenflow overlap] in zenflow_overlap.py)."""
PENDING = "zenflow_pending"
"""`overlap_step`: the finished CPU step's master values not yet in the model's values."""
KEYS = (ACC, SELECTED, EXP_AVG, EXP_AVG_SQ, STEP, GLOBAL, *CPU_MOMENTS, PENDING)


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


@dataclass(slots=True)
class AutoUpdate:
    """The adaptive update interval's state and rule (Note: [zenflow auto update])."""

    topk_ratio: float
    auto_ratio: float
    avg_critic: Tensor
    """1-D float64 on the model's device, one per 2-D weight in plan order."""
    non_critic: Tensor
    """1-D float64, like `avg_critic`."""
    interval: int = 0
    pending: bool = False

    @classmethod
    def zeros(cls, topk_ratio: float, auto_ratio: float, weights: int, device: torch.device) -> "AutoUpdate":
        return cls(topk_ratio, auto_ratio, torch.zeros(weights, dtype=torch.float64, device=device),
                   torch.zeros(weights, dtype=torch.float64, device=device))

    def begin_step(self) -> bool:
        """Start a step; True when the previous step's gradients called for a CPU step now."""
        fire, self.pending = self.pending, False
        if fire:
            self.interval = 0
            self.non_critic.zero_()
        self.interval += 1
        return fire

    def observe(self, total: Tensor, critic: Tensor) -> None:
        """This step's sums of |g| per 2-D weight: over the weight (`total`), over its selected columns."""
        n, r = self.interval, self.topk_ratio
        self.avg_critic = (self.avg_critic * (n - 1) + critic) / n / (r * 10)
        self.non_critic += (total - critic) / ((1 - r) * 10)
        weights = self.avg_critic.numel()
        calls = int((self.non_critic >= self.avg_critic).sum())
        self.pending = weights > 0 and calls >= int(self.auto_ratio * weights)

    def to_state(self) -> dict[str, Any]:
        return {"interval": self.interval, "pending": self.pending, "avg_critic": self.avg_critic.tolist(),
                "non_critic": self.non_critic.tolist()}

    def load(self, state: dict[str, Any]) -> None:
        self.interval, self.pending = int(state["interval"]), bool(state["pending"])
        for name in ("avg_critic", "non_critic"):
            values = torch.tensor(state[name], dtype=torch.float64, device=self.avg_critic.device)
            if values.shape != self.avg_critic.shape:
                raise ValueError(f"zenflow checkpoint state: {name} has {values.numel()} entries, the model has "
                                 f"{self.avg_critic.numel()} 2-D weights")
            setattr(self, name, values)


def export_piece(piece: ZenFlowPiece, shared: dict[str, Any]) -> dict[str, Any]:
    """A fragment's ZenFlow state as checkpoint values: the per-element ones as tensors of the
    fragment's length (so a load at another layout can cut them like exp_avg), the selective
    AdamW's state scattered over the selected elements, and `shared` (the same on every fragment)."""
    out: dict[str, Any] = {ACC: piece.acc, STEP: piece.step, GLOBAL: shared}
    if piece.selected is not None and piece.exp_avg is not None and piece.exp_avg_sq is not None:
        n, at = piece.master.numel(), piece.selected.cpu()
        mask = torch.zeros(n, dtype=torch.bool)
        mask[at] = True
        out[SELECTED] = mask
        for key, values in ((EXP_AVG, piece.exp_avg), (EXP_AVG_SQ, piece.exp_avg_sq)):
            full = torch.zeros(n, dtype=values.dtype)
            full[at] = values.cpu()
            out[key] = full
    return out


def import_piece(piece: ZenFlowPiece, state: dict[str, Any]) -> None:
    """Set a fragment's ZenFlow state from `export_piece`'s values (as loaded)."""
    piece.acc.copy_(state[ACC].reshape(-1))
    piece.step = state[STEP].detach().clone().reshape(()).float().cpu()
    if SELECTED not in state:
        piece.selected = piece.exp_avg = piece.exp_avg_sq = None
        return
    device = piece.lp.device
    piece.selected = state[SELECTED].reshape(-1).to(torch.bool).nonzero().squeeze(1).to(device)
    piece.exp_avg, piece.exp_avg_sq = (
        state[key].reshape(-1).to(device=device, dtype=piece.lp.dtype)[piece.selected].clone()
        for key in (EXP_AVG, EXP_AVG_SQ))
