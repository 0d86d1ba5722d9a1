"""A DeepSpeed 0.19 ZeRO-1/2 checkpoint writer that follows DeepSpeed's layout rules, with plain
torch.save (no DeepSpeed): the in-suite stand-in for the files real DeepSpeed writes, so CI
covers zeroshard's mapping. tests/launch/test_ds_checkpoint_matrix.py checks `plan()` against
files real DeepSpeed wrote.

The rules, read from deepspeed/runtime/zero/stage_1_and_2.py and utils/mixed_precision_linkage.py:
- per parameter group, the trainable parameters in group order (`bit16_groups`); with
  `round_robin_gradients` reordered so that the i-th goes to bucket i % world, buckets in order;
- with `parameter_alignment`, each parameter but the last is followed by zeros up to a multiple
  of 16 bytes of the 16-bit dtype; the flat buffer is then padded to a multiple of 2 * world and
  cut into `world` equal partitions P;
- rank r saves its partition without the padding past the parameters (`group_paddings[g]`
  elements cut off its end), the optimizer's moments whole (P);
- `param_slice_mappings[g]`: name -> (start in the partition, numel) for each parameter with
  elements there, computed in `bit16_groups` order with offsets running over that order (with
  round-robin and no per-parameter padding DeepSpeed's addresses are then not where the data is);
- the model file's `param_shapes[g]` lists the parameters in flat (round-robin) order.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


@dataclass
class RankPlan:
    lean_numel: list[int]
    """Per group: the elements of the saved fp32 partition."""
    group_paddings: list[int]
    mappings: list[dict[str, tuple[int, int]]]


@dataclass
class Plan:
    flat_order: list[list[str]]
    """Per group: names in flat order (the model file's param_shapes order)."""
    offsets: list[dict[str, int]]
    param_paddings: list[list[int]]
    partition: list[int]
    ranks: list[RankPlan]


def _round_robin(names: list[str], world: int) -> list[str]:
    buckets: dict[int, list[str]] = {}
    for i, n in enumerate(names):
        buckets.setdefault(i % world, []).append(n)
    return [n for b in buckets.values() for n in b]


def plan(groups: list[list[tuple[str, int]]], world: int, *, round_robin: bool = False,
         parameter_alignment: bool = False, element_size: int = 4) -> Plan:
    """The layout of `groups` (per group: (name, numel) in group order) at `world` ranks."""
    flat_order, offsets, paddings, partition = [], [], [], []
    ranks = [RankPlan([], [], []) for _ in range(world)]
    align = 16 // math.gcd(16, element_size) if parameter_alignment else 1
    for group in groups:
        numel = dict(group)
        names = [n for n, _ in group]
        order = _round_robin(names, world) if round_robin else names
        pos, offs, pads = 0, {}, []
        for k, n in enumerate(order):
            offs[n] = pos
            pos += numel[n]
            pad = 0 if k == len(order) - 1 else (-pos) % align
            pads.append(pad)
            pos += pad
        padded_numel = pos
        total = math.ceil(pos / (2 * world)) * 2 * world
        part = total // world
        flat_order.append(order)
        offsets.append(offs)
        paddings.append(pads)
        partition.append(part)
        # DeepSpeed's mapping offsets: per-parameter offsets with padding, else a running sum in group order
        map_offs = offs if any(pads) else dict(zip(names, itertools_accumulate([numel[n] for n in names]), strict=True))
        for r in range(world):
            lo, hi = r * part, (r + 1) * part
            if padded_numel <= lo:
                gpad = part
            elif padded_numel < hi:
                gpad = hi - padded_numel
            else:
                gpad = 0
            mapping = {}
            for n in names:
                a, b = max(map_offs[n], lo), min(map_offs[n] + numel[n], hi)
                if a < b:
                    mapping[n] = (a - lo, b - a)
            ranks[r].lean_numel.append(part - gpad)
            ranks[r].group_paddings.append(gpad)
            ranks[r].mappings.append(mapping)
    return Plan(flat_order, offsets, paddings, partition, ranks)


def itertools_accumulate(sizes: list[int]) -> list[int]:
    """Start offsets of consecutive sizes."""
    out, pos = [], 0
    for s in sizes:
        out.append(pos)
        pos += s
    return out


def write_zero12(root: Path, groups: list[list[tuple[str, Tensor]]], world: int, *, stage: int = 2,
                 frozen: dict[str, Tensor] | None = None, tied: dict[str, str] | None = None,
                 round_robin: bool = False, parameter_alignment: bool = False,
                 lp_dtype: torch.dtype = torch.float32, tag: str = "global_step3") -> dict[str, Tensor]:
    """Write a DeepSpeed ZeRO-`stage` checkpoint of fp32 masters `groups` at `world` ranks under
    `root/tag`; returns the moments per parameter ({name + ".exp_avg": ...}) for checking."""
    frozen, tied = frozen or {}, tied or {}
    esize = torch.tensor([], dtype=lp_dtype).element_size()
    p = plan([[(n, t.numel()) for n, t in g] for g in groups], world, round_robin=round_robin,
             parameter_alignment=parameter_alignment, element_size=esize)
    ckpt = root / tag
    ckpt.mkdir(parents=True)
    (root / "latest").write_text(tag)
    values = {n: t for g in groups for n, t in g}
    moments = {}
    flats, avgs = [], []
    for g, group in enumerate(groups):
        flat = torch.zeros(p.partition[g] * world)
        avg = torch.zeros_like(flat)
        for n, t in group:
            o = p.offsets[g][n]
            flat[o : o + t.numel()] = t.reshape(-1)
            m = torch.linspace(-1, 1, t.numel()) + 0.25 * g
            avg[o : o + t.numel()] = m
            moments[n + ".exp_avg"] = m
        flats.append(flat)
        avgs.append(avg)
    module = {n: t.to(lp_dtype) for n, t in values.items()}
    module.update({n: t.to(lp_dtype) for n, t in frozen.items()})
    module.update({alias: module[owner] for alias, owner in tied.items()})
    zero: dict[str, Any] = {"stage": stage, "round_robin_gradients": round_robin,
                            "parameter_alignment": parameter_alignment}
    cfg: dict[str, Any] = {"zero_optimization": zero}
    if lp_dtype == torch.bfloat16:
        cfg["bf16"] = {"enabled": True}
    elif lp_dtype == torch.float16:
        cfg["fp16"] = {"enabled": True}
    shapes = [OrderedDict((n, values[n].shape) for n in order) for order in p.flat_order]
    torch.save({"module": module, "buffer_names": [], "optimizer": None, "param_shapes": shapes,
                "frozen_param_shapes": OrderedDict((n, t.shape) for n, t in frozen.items()) or None,
                "shared_params": dict(tied), "lr_scheduler": None, "global_steps": 3, "global_samples": 24,
                "skipped_steps": 0, "dp_world_size": world, "mp_world_size": 1, "ds_config": cfg,
                "ds_version": "0.19.8"}, ckpt / "mp_rank_00_model_states.pt")
    prefix = "bf16_" if lp_dtype == torch.bfloat16 else ""
    for r, rp in enumerate(p.ranks):
        lean, state = [], {}
        for g in range(len(groups)):
            part = p.partition[g]
            lean.append(flats[g][r * part : r * part + rp.lean_numel[g]].clone())
            full = avgs[g][r * part : (r + 1) * part].clone()
            state[g] = {"step": torch.tensor(3.0), "exp_avg": full, "exp_avg_sq": full.abs()}
        osd = {"loss_scaler": {"cur_scale": 1.0}, "dynamic_loss_scale": False, "overflow": False, "clip_grad": 1.0,
               "base_optimizer_state": {"state": state, "param_groups": [{"lr": 0.1, "params": [g]}
                                                                        for g in range(len(groups))]},
               "single_partition_of_fp32_groups": lean, "zero_stage": stage, "group_paddings": rp.group_paddings,
               "param_alignment_paddings": p.param_paddings, "partition_count": [world] * len(groups),
               "ds_version": "0.19.8",
               "param_slice_mappings": [OrderedDict((n, {"start": s, "numel": k}) for n, (s, k) in m.items())
                                        for m in rp.mappings]}
        torch.save({"optimizer_state_dict": osd, "ds_config": cfg, "ds_version": "0.19.8"},
                   ckpt / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    return moments
