"""Reading DeepSpeed 0.19 checkpoint files without DeepSpeed: detection, safe unpickling, refusals.

DeepSpeed pickles four of its own classes into its optimizer files (the loss scaler, the ZeRO
stage enum, the fragment address of `param_slice_mappings`). They are loaded here as plain
stand-ins under torch's `weights_only` unpickler, so no code from the file runs and zeroshard
never imports DeepSpeed. Imports only checkpoint/files.py, errors and torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.files import LATEST, MANIFEST, read_latest_tag
from zeroshard.errors import CheckpointError

DS_MODEL_FILE = "mp_rank_00_model_states.pt"


class _Record:
    """A DeepSpeed object unpickled as its attribute dict (BUILD fills `__dict__`)."""

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})


class _ZeroStageEnum(int):
    """deepspeed.runtime.zero.config.ZeroStageEnum: an IntEnum, pickled as its value."""


class _LossScaler(_Record):
    pass


class _DynamicLossScaler(_Record):
    pass


class _FragmentAddress(_Record):
    """deepspeed.utils.tensor_fragment.fragment_address: `start` in the rank's partition, `numel`."""


_STAND_INS: list[Any] = [
    (_ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def load_ds(path: Path) -> dict[str, Any]:
    """torch.load of a DeepSpeed file: weights_only (DeepSpeed's classes as stand-ins), mmap."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (a DeepSpeed checkpoint of this layout has it)")
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises many types for a corrupt zip/pickle
        first = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"{path}: not a readable DeepSpeed checkpoint file ({type(e).__name__}: {first})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a DeepSpeed checkpoint file (a {type(data).__name__})")
    return data


def loss_scaler_state(scaler: Any) -> dict[str, Any] | None:
    """DeepSpeed's loss scaler (stand-in object or stage-0 dict) as zeroshard's state dict."""
    d = scaler.__dict__ if isinstance(scaler, _Record) else scaler
    if not isinstance(d, dict) or "cur_scale" not in d:
        return None
    if "cur_iter" not in d:  # static scale: DeepSpeed's LossScaler (fp32, bf16, fixed fp16 scale)
        return {"cur_scale": float(d["cur_scale"])}
    out = {"cur_scale": float(d["cur_scale"]), "cur_iter": int(d["cur_iter"]),
           "last_overflow_iter": int(d.get("last_overflow_iter", -1))}
    if "cur_hysteresis" in d:
        out["cur_hysteresis"] = int(d["cur_hysteresis"])
    return out


def address(value: Any) -> tuple[int, int]:
    """(start, numel) of a `param_slice_mappings` entry."""
    d = value.__dict__ if isinstance(value, _Record) else value
    return int(d["start"]), int(d["numel"])


# -- what a DeepSpeed checkpoint directory holds ------------------------------------------------


def optim_name(rank: int, bf16: bool, tp_rank: int = 0) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_{tp_rank:02d}_optim_states.pt"


def model_name(tp_rank: int = 0) -> str:
    """The model file of tensor-parallel (AutoTP) rank `tp_rank` (ZeRO stages 0-2); DeepSpeed names it mp_rank."""
    return f"mp_rank_{tp_rank:02d}_model_states.pt"


def zero3_model_name(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


@dataclass(frozen=True, slots=True)
class DsFiles:
    """The files of one DeepSpeed tag directory: `model` holds the module (stages 0-2) or rank
    0's stage-3 model file; `optim[r]` is rank r's optimizer file (empty at stage 0)."""

    ckpt: Path
    model: str
    zero3_models: list[str]
    optim: list[str]


_UNMAPPABLE = [
    (re.compile(r"^layer_\d+-model_\d+-model_states\.pt$|^layer_\d+-model_states\.pt$"),
     ("a pipeline-parallel layer file (DeepSpeed's pipeline checkpoint): load it with a zeroshard.pipe."
     "PipelineModule of the same layers, whose engine reads it at any stage count (docs/checkpoints.md)")),
    (re.compile(r"^(bf16_)?zero_pp_rank_\d+_mp_rank_(0[1-9]|[1-9]\d)_.*\.pt$"
                r"|^mp_rank_(0[1-9]|[1-9]\d)_model_states\.pt$"),
     ("a tensor/model-parallel rank's file (mp_rank > 0): an AutoTP checkpoint, which an engine's load_checkpoint "
      "reads into the model (docs/checkpoints.md), not this offline reader")),
    (re.compile(r"^expert_\d+_mp_rank_\d+_model_states\.pt$"),
     ("an MoE expert file without a layer id (DeepSpeed's layout before layer_<L>_expert_<E> files): zeroshard "
      "maps the layer_<L>_expert_<E> layout of DeepSpeed 0.19; load it into DeepSpeed 0.19 and save it again")),
]


def is_deepspeed_dir(ckpt: Path) -> bool:
    """A tag directory DeepSpeed wrote: no zeroshard manifest, one of DeepSpeed's model files."""
    return (ckpt.is_dir() and not (ckpt / MANIFEST).exists()
            and ((ckpt / DS_MODEL_FILE).is_file() or (ckpt / zero3_model_name(0)).is_file()))


def resolve_ds(load_dir: Path, tag: str | None) -> Path | None:
    """The DeepSpeed tag directory `tag` (None: `latest`) of `load_dir`, or None when it is not one."""
    if not load_dir.is_dir():
        return None
    if tag is None:
        latest = load_dir / LATEST
        if not latest.is_file():
            return None
        tag = read_latest_tag(latest)
    ckpt = load_dir / str(tag)
    return ckpt if is_deepspeed_dir(ckpt) else None


def list_files(ckpt: Path, world_size: int, zero_stage: int, tp_rank: int = 0, tp: int = 1) -> DsFiles:
    """Check the directory holds exactly one data-parallel layout we can map; refuse the rest.
    `tp_rank` / `tp`: the files of AutoTP rank `tp_rank` of `tp` (checkpoint/ds_autotp.py joins them)."""
    names = sorted(p.name for p in ckpt.iterdir() if p.is_file())
    for name in names:
        for pattern, reason in _UNMAPPABLE[:1] + (_UNMAPPABLE[2:] if tp > 1 else _UNMAPPABLE[1:]):
            if pattern.match(name):
                raise CheckpointError(f"{ckpt / name}: {reason}; this checkpoint cannot be loaded by zeroshard")
    if zero_stage == 0:
        optim: list[str] = []
        bf16 = (ckpt / optim_name(0, True, tp_rank)).is_file()
        if bf16:  # a BF16_Optimizer file (bf16, fp32 grad accumulation) partitions like ZeRO-1
            optim = [optim_name(r, True, tp_rank) for r in range(world_size)]
    else:
        bf16 = (ckpt / optim_name(0, True, tp_rank)).is_file()
        optim = [optim_name(r, bf16, tp_rank) for r in range(world_size)]
    for name in optim:
        if not (ckpt / name).is_file():
            raise CheckpointError(f"{ckpt / name}: missing; the checkpoint was saved by {world_size} data-parallel "
                                  "ranks and each writes one optimizer file")
    ranks = [(n, re.match(r"^(?:bf16_)?zero_pp_rank_(\d+)_", n)) for n in names]
    extra = [n for n, m in ranks if m is not None and int(m.group(1)) >= world_size]
    if extra:
        raise CheckpointError(f"{ckpt / extra[0]}: a rank >= dp_world_size ({world_size}) recorded in the model "
                              "file; files from two different saves are mixed in this directory")
    zero3 = [zero3_model_name(r) for r in range(world_size)] if zero_stage == 3 else []
    for name in zero3:
        if not (ckpt / name).is_file():
            raise CheckpointError(f"{ckpt / name}: missing (stage 3 writes one model file per rank)")
    return DsFiles(ckpt=ckpt, model=zero3[0] if zero_stage == 3 else model_name(tp_rank), zero3_models=zero3,
                   optim=optim)


def check_parallelism(model: dict[str, Any], path: Path, tp_ok: bool = False, moe_ok: bool = False) -> None:
    """Refuse pipeline/tensor-parallel saves, which zeroshard cannot map here (`tp_ok`: an AutoTP
    save, read per tensor-parallel rank by checkpoint/ds_autotp.py; `moe_ok`: legacy MoE layers,
    read by checkpoint/ds_moe.py)."""
    dims = model.get("checkpoint_parallel_dimensions") or {}
    mp_world_size = int(model.get("mp_world_size", 1) or 1)
    pp, tp = int(dims.get("pp_degree", 1) or 1), int(dims.get("tp_degree", 1) or 1)
    if (mp_world_size > 1 or tp > 1) and tp_ok and pp == 1:
        pass
    elif mp_world_size > 1 or pp > 1 or tp > 1:
        raise CheckpointError(f"{path}: saved with model parallelism (mp_world_size {mp_world_size}, pp_degree {pp}, "
                              f"tp_degree {tp}); zeroshard loads data-parallel (ZeRO) checkpoints only")
    if not moe_ok and (model.get("num_experts") or model.get("ds_autoep_layers")):
        raise CheckpointError(f"{path}: an MoE checkpoint (expert parallelism) with tensor or pipeline parallelism; "
                              "zeroshard maps DeepSpeed's legacy MoE checkpoints of data and expert parallelism only")


def check_slices(osd: dict[str, Any], g: int, mine: dict[str, tuple[int, int]], check_maps: bool,
                  path: Path) -> None:
    """Group `g` of one rank's file: its `param_slice_mappings` are where the flat layout rules put
    the parameters (`mine`: name -> start, numel), and its fp32 partition holds them."""
    saved = {n: address(a) for n, a in osd["param_slice_mappings"][g].items()}
    if check_maps and saved != mine:
        bad = sorted(set(saved.items()) ^ set(mine.items()))[:3]
        raise CheckpointError(f"{path}: param_slice_mappings of group {g} disagree with DeepSpeed's flat layout "
                              f"rules (first differences: {bad}): not a layout zeroshard understands")
    lean = osd["single_partition_of_fp32_groups"][g].numel()
    beyond = [(n, start, numel) for n, (start, numel) in mine.items() if start + numel > lean]
    if beyond:
        raise CheckpointError(f"{path}: group {g}'s partition holds {lean} elements, "
                              f"parameter {beyond[0][0]!r} needs [{beyond[0][1]}, {sum(beyond[0][1:])})")
