"""DeepSpeed 0.19's pipeline checkpoints: one source per saved pipeline stage, for checkpoint/pipe_files.py.

What DeepSpeed's pipeline engine writes into `tag/` (read from its 0.19.8 files, ZeRO-0 and ZeRO-1):
- `layer_XX-model_states.pt`: layer XX's state dict (global index; written by each stage's first
  data-parallel rank; a tied layer with a `forward_fn` has none, its module is saved at the layer
  that built it without one);
- `mp_rank_SS_model_states.pt` per stage SS (the "model-parallel rank" of a pipe x data grid is the
  stage): `module` None (the layer files hold it), counters, `mp_world_size` = stages; at ZeRO-0
  `optimizer` is the stage optimizer's torch state dict (parameters numbered in the stage module's
  order: its tied modules first, then its layers); at ZeRO-1 `param_shapes` names them;
- `zero_pp_rank_D_mp_rank_SS_optim_states.pt` (ZeRO-1): stage SS's data-parallel rank D's partition.
Each stage is then a DeepSpeed data-parallel checkpoint whose "module" is assembled from its layer
files, read by checkpoint/ds_import.py's layouts. Names are the PipelineModule's (global layer
index, `tied_modules.<key>`), which the stage's layers come from: the loading model's partition
for the saved stage count (DeepSpeed's boundaries, pipe/partition.py) and its tie keys.
Imports checkpoint/ and checkpoint_format only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zeroshard.checkpoint.ds_files import DsFiles, load_ds
from zeroshard.checkpoint.ds_import import DeepSpeedReader, _hint_from_module, _precision, _zero_stage0, _zero_stage12
from zeroshard.checkpoint.pipe_files import TIED_PREFIX, PipeLayout, Source, layer_file
from zeroshard.checkpoint_format import Manifest, TensorInfo
from zeroshard.errors import CheckpointError

_LAYER = re.compile(r"^layer_(\d+)-model_states\.pt$")


def ds_model_file(stage: int) -> str:
    return f"mp_rank_{stage:02d}_model_states.pt"


def ds_optim_file(dp_rank: int, stage: int, bf16: bool = False) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{stage:02d}_optim_states.pt"


def is_deepspeed_pipeline(ckpt: Path) -> bool:
    """A tag directory DeepSpeed's pipeline engine wrote: layer files and stage model files."""
    return (ckpt / ds_model_file(0)).is_file() and any(_LAYER.match(p.name) for p in ckpt.iterdir())


def _stage_module(ckpt: Path, lo: int, hi: int, tied: dict[str, list[int]]) -> dict[str, Tensor]:
    """Stage [lo, hi)'s weights from the layer files, in the stage module's parameter order."""
    key_of = {i: k for k, idx in tied.items() for i in idx}
    out: dict[str, Tensor] = {}
    for key in dict.fromkeys(key_of[i] for i in range(lo, hi) if i in key_of):
        held = [i for i in tied[key] if (ckpt / layer_file(i)).is_file()]
        if not held:
            raise CheckpointError(f"{ckpt}: no layer file holds tied module {key!r} (layers {tied[key]})")
        for n, t in load_ds(ckpt / layer_file(held[0])).items():
            out[f"{TIED_PREFIX}{key}.{n}"] = t
    for i in range(lo, hi):
        if i not in key_of and (ckpt / layer_file(i)).is_file():
            for n, t in load_ds(ckpt / layer_file(i)).items():
                out[f"{i}.{n}"] = t
    return out


def _stage_source(ckpt: Path, stage: int, lo: int, hi: int, tied: dict[str, list[int]]) -> DeepSpeedReader:
    model: dict[str, Any] = dict(load_ds(ckpt / ds_model_file(stage)))
    model["module"] = _stage_module(ckpt, lo, hi, tied)
    shapes = model.get("param_shapes")
    if shapes:
        named = {n for g in shapes for n in g}
        if not named <= set(model["module"]):
            raise CheckpointError(
                f"{ckpt / ds_model_file(stage)}: stage {stage} holds {sorted(named - set(model['module']))[:3]}, "
                f"not among layers [{lo}, {hi}) of this model's partition: the checkpoint was cut with another "
                "partition_method; load it into a PipelineModule with the saving one")
    zero_stage = int(((model.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0))
    dp = int(model.get("dp_world_size", 1) or 1)
    bf16 = (ckpt / ds_optim_file(0, stage, True)).is_file()
    optim = [ds_optim_file(d, stage, bf16) for d in range(dp)] if zero_stage > 0 or bf16 else []
    for name in optim:
        if not (ckpt / name).is_file():
            raise CheckpointError(f"{ckpt / name}: missing; stage {stage} was saved by {dp} data-parallel ranks")
    if zero_stage > 1:
        raise CheckpointError(f"{ckpt}: a pipeline checkpoint at ZeRO stage {zero_stage}, which DeepSpeed 0.19 "
                              "does not write (ZeRO-2/3 are refused with a pipeline there)")
    files = DsFiles(ckpt=ckpt, model=ds_model_file(stage), zero3_models=[], optim=optim)
    hint = _hint_from_module(model)
    layout = _zero_stage0(files, model, hint) if not optim else _zero_stage12(files, model, hint, max(zero_stage, 1))
    return DeepSpeedReader(layout)


def deepspeed_pipeline_sources(ckpt: Path, target: PipeLayout) -> list[Source]:
    """One source per stage of DeepSpeed pipeline tag directory `ckpt`, in the pipeline's names.

    Raises:
        CheckpointError: not DeepSpeed's pipeline layout, another model, or a layout we cannot map.
    """
    if not is_deepspeed_pipeline(ckpt):
        raise CheckpointError(f"{ckpt}: neither a zeroshard checkpoint (no zeroshard_manifest.json or pipeline.json) "
                              "nor DeepSpeed's pipeline checkpoint (layer_XX-model_states.pt and "
                              "mp_rank_XX_model_states.pt)")
    first = load_ds(ckpt / ds_model_file(0))
    dims = first.get("checkpoint_parallel_dimensions") or {}
    pp = int(dims.get("pp_degree") or first.get("mp_world_size") or 1)
    if int(dims.get("tp_degree", 1) or 1) > 1:
        raise CheckpointError(f"{ckpt}: saved with tensor parallelism too (tp_degree {dims['tp_degree']}); "
                              "zeroshard reads DeepSpeed pipeline x data-parallel checkpoints")
    if target.partition is None:
        raise AssertionError("expected the loading model's partition function in its PipeLayout")
    parts = target.partition(pp)
    return [Source(_stage_source(ckpt, s, parts[s], parts[s + 1], target.tied), lambda n: n) for s in range(pp)]


class WeightsReader:
    """The reader interface (checkpoint/load.py) over whole tensors in memory: to-fp32 of DeepSpeed's
    pipeline layer files. fp32 training: the weights are the fp32 masters."""

    def __init__(self, ckpt: Path, tensors: dict[str, Tensor], manifest: Manifest) -> None:
        self.ckpt, self._tensors, self.manifest = ckpt, tensors, manifest

    def master_index(self, prefer: int | None = None) -> None:
        return None

    def masters(self, index: None, name: str, offset: int, numel: int,
                with_state: bool = True) -> tuple[Tensor, dict[str, Any]]:
        return self.weights(name, offset, numel, torch.float32), {}

    def weights(self, name: str, offset: int, numel: int, dtype: torch.dtype) -> Tensor:
        return self._tensors[name].reshape(-1)[offset : offset + numel].to(dtype, copy=True)

    def module(self) -> dict[str, Tensor]:
        return self._tensors

    def close(self) -> None:
        pass


def offline_deepspeed_pipeline(ckpt: Path) -> tuple[Path, Manifest, Callable[[], WeightsReader]]:
    """DeepSpeed pipeline tag directory `ckpt` for to-fp32: every layer file's tensors named as the
    model without a pipeline names them (`"<layer>.<name>"`: a tied module at the layer that saved
    it, the first of its key without a forward_fn). Under fp32 these are the fp32 weights; under
    fp16/bf16 they are the 16-bit weights, cast (the fp32 masters are not consolidated: a warning)."""
    tensors: dict[str, Tensor] = {}
    for idx, path in sorted((int(m.group(1)), p) for p in ckpt.iterdir() if (m := _LAYER.match(p.name))):
        for n, t in load_ds(path).items():
            tensors[f"{idx}.{n}"] = t
    first = load_ds(ckpt / ds_model_file(0))
    fp32 = _precision(first) == "fp32"
    buffers = set(first.get("buffer_names") or [])
    params = [TensorInfo(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), True)
              for n, t in tensors.items() if n.partition(".")[2] not in buffers]
    manifest = Manifest(world_size=1, zero_stage=0, precision=_precision(first), params=params, aliases={}, buffers=[],
                        optimizer="deepspeed", param_groups=1, fragments=[[]], weight_pieces=None,
                        has_optimizer_states=fp32, global_steps=int(first.get("global_steps", 0)), tag=ckpt.name)
    return ckpt, manifest, lambda: WeightsReader(ckpt, tensors, manifest)
