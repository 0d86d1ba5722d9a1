"""A DeepSpeed 0.19 pipeline checkpoint writer (ZeRO-0 and ZeRO-1, fp32), with plain torch.save: the
in-suite stand-in for the files DeepSpeed's pipeline engine writes (CI has no DeepSpeed;
tests/differential/test_pipeline_differential.py loads real ones).

The rules, read from deepspeed/runtime/pipe/{engine,module}.py and runtime/engine.py
(`_get_ckpt_name`, `_get_zero_ckpt_name`) and from files DeepSpeed 0.19.8 wrote on this CPU:
- `layer_XX-model_states.pt`: layer XX's state dict, for each layer that is a module (a tied layer
  with a forward_fn has none);
- `mp_rank_SS_model_states.pt` per stage SS: `module` None, `mp_world_size` = stages,
  `checkpoint_parallel_dimensions` {pp_degree, tp_degree}; ZeRO-0: `optimizer` = the stage's torch
  AdamW state dict, parameters numbered in the stage module's order (tied modules, then layers);
  ZeRO-1: `param_shapes` = [that order's names -> shapes];
- ZeRO-1: `zero_pp_rank_D_mp_rank_SS_optim_states.pt` per (data-parallel rank D, stage SS), one
  flat group partitioned as tests/unit/ds_layout.py's `plan` does.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from ds_layout import plan


def write_ds_pipeline(ckpt: Path, stages: list[list[str]], params: dict[str, tuple[Tensor, dict[str, Any]]],
                      layers: dict[int, dict[str, Tensor]], *, zero: int, dp: int, global_steps: int,
                      param_group: dict[str, Any]) -> None:
    """Write DeepSpeed's pipeline files into tag directory `ckpt`.

    stages: per stage, its parameter names in the stage module's order; params: name -> (fp32
    value, AdamW state {step, exp_avg, exp_avg_sq}); layers: layer index -> its state dict.
    """
    ckpt.mkdir(parents=True)
    (ckpt.parent / "latest").write_text(ckpt.name)
    for idx, sd in layers.items():
        torch.save(OrderedDict(sd), ckpt / f"layer_{idx:02d}-model_states.pt")
    cfg = {"zero_optimization": {"stage": zero}, "train_micro_batch_size_per_gpu": 1}
    for s, names in enumerate(stages):
        model: dict[str, Any] = {
            "module": None, "buffer_names": [], "optimizer": None, "param_shapes": None, "frozen_param_shapes": None,
            "shared_params": {} if zero else None, "frozen_param_fragments": None, "lr_scheduler": None,
            "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": global_steps,
            "global_samples": 0, "dp_world_size": dp, "mp_world_size": len(stages),
            "checkpoint_parallel_dimensions": {"pp_degree": len(stages), "tp_degree": 1}, "ds_config": cfg,
            "ds_version": "0.19.8"}
        if zero == 0:
            model["optimizer"] = {"state": {i: dict(params[n][1]) for i, n in enumerate(names)},
                                  "param_groups": [{**param_group, "params": list(range(len(names)))}]}
        else:
            model["param_shapes"] = [OrderedDict((n, params[n][0].shape) for n in names)]
            _write_zero1(ckpt, s, names, params, dp, cfg, param_group)
        torch.save(model, ckpt / f"mp_rank_{s:02d}_model_states.pt")


def _write_zero1(ckpt: Path, stage: int, names: list[str], params: dict[str, tuple[Tensor, dict[str, Any]]],
                 dp: int, cfg: dict[str, Any], param_group: dict[str, Any]) -> None:
    p = plan([[(n, params[n][0].numel()) for n in names]], dp)
    size = p.partition[0]
    flats = {k: torch.zeros(size * dp) for k in ("master", "exp_avg", "exp_avg_sq")}
    for n in names:
        o, value, state = p.offsets[0][n], params[n][0], params[n][1]
        flats["master"][o : o + value.numel()] = value.reshape(-1)
        for k in ("exp_avg", "exp_avg_sq"):
            flats[k][o : o + value.numel()] = state[k].reshape(-1)
    step = params[names[0]][1]["step"]
    for r, rp in enumerate(p.ranks):
        lean = flats["master"][r * size : r * size + rp.lean_numel[0]].clone()
        state = {0: {"step": step, **{k: flats[k][r * size : (r + 1) * size].clone()
                                      for k in ("exp_avg", "exp_avg_sq")}}}
        osd = {"loss_scaler": {"cur_scale": 1.0}, "dynamic_loss_scale": False, "overflow": False, "clip_grad": 0.5,
               "base_optimizer_state": {"state": state, "param_groups": [{**param_group, "params": [0]}]},
               "single_partition_of_fp32_groups": [lean], "zero_stage": 1, "group_paddings": rp.group_paddings,
               "param_alignment_paddings": p.param_paddings, "partition_count": [dp], "ds_version": "0.19.8",
               "param_slice_mappings": [OrderedDict((n, {"start": s, "numel": k})
                                                    for n, (s, k) in rp.mappings[0].items())]}
        torch.save({"optimizer_state_dict": osd, "ds_config": cfg, "ds_version": "0.19.8"},
                   ckpt / f"zero_pp_rank_{r}_mp_rank_{stage:02d}_optim_states.pt")
