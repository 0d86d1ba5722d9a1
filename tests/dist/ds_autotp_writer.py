"""A DeepSpeed 0.19 AutoTP checkpoint writer with plain torch.save (no DeepSpeed), for the in-suite
test of checkpoint/ds_autotp.py. The layout is what DeepSpeed 0.19.8 wrote for the tiny Llama at
TP 2 x DP 1 and 2, ZeRO 0/1/2 (tests/differential/test_autotp_checkpoint.py loads the real files):

- `mp_rank_{t:02d}_model_states.pt` per TP rank t: `module` = TP rank t's pieces under the global
  names (a column split cuts dim 0, a row split dim 1, the rest whole), `param_shapes` = [the local
  shapes in model order], `dp_world_size`, `mp_world_size` = tp,
  `checkpoint_parallel_dimensions` {pp_degree 1, tp_degree tp}; at ZeRO-0 `optimizer` is the
  torch optimizer's state dict of the local pieces;
- ZeRO-1/2: `zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt` per (dp rank d, TP rank t): TP rank
  t's local parameters flattened in order, padded to a multiple of 2 * dp, cut into dp partitions;
  rank d saves its partition without the padding (`group_paddings`), the moments whole, and
  `param_slice_mappings` (name -> start, numel in the partition).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


def piece(value: Tensor, dim: int | None, tp: int, t: int) -> Tensor:
    return value if dim is None else value.chunk(tp, dim)[t].contiguous()


def write_autotp(root: Path, tag: str, *, tp: int, dp: int, stage: int, weights: dict[str, Tensor],
                 state: dict[str, dict[str, Tensor]], param_groups: list[dict[str, Any]],
                 splits: dict[str, int | None], global_steps: int) -> None:
    """Write `weights` (fp32, model order) with Adam `state` (name -> step, exp_avg, exp_avg_sq) as
    DeepSpeed's AutoTP files of TP `tp` x DP `dp` at ZeRO `stage` under root/tag."""
    ckpt = root / tag
    ckpt.mkdir(parents=True)
    (root / "latest").write_text(tag)
    cfg = {"zero_optimization": {"stage": stage}, "tensor_parallel": {"autotp_size": tp}}
    names = list(weights)
    for t in range(tp):
        local = {n: piece(weights[n], splits.get(n), tp, t) for n in names}
        moments = {n: {k: (piece(v, splits.get(n), tp, t) if v.dim() else v) for k, v in state[n].items()}
                   for n in names}
        optimizer = None
        if stage == 0:
            groups = [{**g, "params": list(range(len(names)))} for g in param_groups]
            optimizer = {"state": {i: moments[n] for i, n in enumerate(names)}, "param_groups": groups}
        torch.save({"module": local, "buffer_names": [], "optimizer": optimizer,
                    "param_shapes": [OrderedDict((n, local[n].shape) for n in names)],
                    "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
                    "lr_scheduler": None, "global_steps": global_steps, "global_samples": 0, "skipped_steps": 0,
                    "dp_world_size": dp, "mp_world_size": tp,
                    "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": tp},
                    "ds_config": cfg, "ds_version": "0.19.8"}, ckpt / f"mp_rank_{t:02d}_model_states.pt")
        if stage == 0:
            continue
        flat = torch.cat([local[n].reshape(-1) for n in names])
        avg = torch.cat([moments[n]["exp_avg"].reshape(-1) for n in names])
        sq = torch.cat([moments[n]["exp_avg_sq"].reshape(-1) for n in names])
        used = flat.numel()
        total = -(-used // (2 * dp)) * 2 * dp
        part = total // dp
        flat, avg, sq = (torch.nn.functional.pad(x, (0, total - used)) for x in (flat, avg, sq))
        starts, pos = {}, 0
        for n in names:
            starts[n] = pos
            pos += local[n].numel()
        for d in range(dp):
            lo, hi = d * part, (d + 1) * part
            pad = part - max(0, min(part, used - lo))
            mapping = OrderedDict()
            for n in names:
                a, b = max(starts[n], lo), min(starts[n] + local[n].numel(), hi)
                if a < b:
                    mapping[n] = {"start": a - lo, "numel": b - a}
            step = state[names[0]]["step"]
            osd = {"loss_scaler": {"cur_scale": 1.0}, "dynamic_loss_scale": False, "overflow": False,
                   "clip_grad": 0.5, "zero_stage": stage, "group_paddings": [pad],
                   "param_alignment_paddings": [[0] * len(names)], "partition_count": [dp],
                   "single_partition_of_fp32_groups": [flat[lo : hi - pad].clone()],
                   "base_optimizer_state": {"state": {0: {"step": step.clone(), "exp_avg": avg[lo:hi].clone(),
                                                          "exp_avg_sq": sq[lo:hi].clone()}},
                                            "param_groups": [{**g, "params": [0]} for g in param_groups]},
                   "param_slice_mappings": [mapping], "ds_version": "0.19.8"}
            torch.save({"optimizer_state_dict": osd, "ds_config": cfg, "ds_version": "0.19.8"},
                       ckpt / f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt")
