"""DeepSpeed's universal checkpoints (`ds_to_universal` output) read as zeroshard's fragments.

A universal checkpoint holds every trainable parameter whole: `<tag>/zero/<name>/fp32.pt`,
`exp_avg.pt`, `exp_avg_sq.pt` (stages 0-2: `{"param": tensor}` in the parameter's shape; stage
3: a flat tensor) and `step.pt` (stages 0-2; stage 3 keeps the step in `zero/optimizer_state.pt`'s
inner optimizer state), plus `zero/optimizer_state.pt` (loss scaler, `param_groups`) and the
model files of the save copied beside it (module buffers, scheduler, counters, client state).
DeepSpeed writes `latest_universal` next to the tag.

Seen from zeroshard it is a checkpoint saved by one rank that holds every parameter as one
fragment, so it loads through the same path as every other (checkpoint/load.py): checked
against the model first, read into this rank's ranges, applied only when every rank succeeded,
at any world size and ZeRO stage. Frozen parameters, which DeepSpeed's own universal load leaves
at their initial values, are restored from the checkpoint where it has them (stages 0-2:
`zero/<name>/fp32.pt`; stage 3: the `frozen_param_fragments` of the copied per-rank files).
Imports checkpoint/ds_import.py, ds_files.py, files.py, load.py, agreed.py, checkpoint_format,
errors and torch (comm only for a type).
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from zeroshard.checkpoint.agreed import read_agreed
from zeroshard.checkpoint.ds_files import DS_MODEL_FILE, DsFiles, load_ds, loss_scaler_state
from zeroshard.checkpoint.ds_import import DeepSpeedReader, DsLayout, _buffers, _new_manifest, _precision
from zeroshard.checkpoint.files import LATEST, load_torch, read_latest_tag
from zeroshard.checkpoint.load import read_checked
from zeroshard.checkpoint_format import EngineState, LoadedState, Manifest, TensorInfo
from zeroshard.errors import CheckpointError

if TYPE_CHECKING:
    from zeroshard.comm import Comm

logger = logging.getLogger("zeroshard")

LATEST_UNIVERSAL = "latest_universal"
"""The file naming the newest universal tag (DeepSpeed's converter writes it next to the tag)."""
ZERO_DIR = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")


def is_universal_dir(ckpt: Path) -> bool:
    """A universal tag directory: `zero/optimizer_state.pt` and one of DeepSpeed's model files."""
    return ((ckpt / ZERO_DIR / OPTIMIZER_STATE).is_file()
            and ((ckpt / DS_MODEL_FILE).is_file() or (ckpt / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file()))


def find_universal(load_dir: str | os.PathLike[str], tag: str | None, prefer: bool = False) -> Path | None:
    """The universal tag directory to load, or None when `load_dir`/`tag` is not one.

    Without a tag: `latest_universal` names it where there is no `latest`, or always when
    `prefer` (`checkpoint.load_universal`, as DeepSpeed reads it)."""
    root = Path(load_dir)
    if not root.is_dir():
        return None
    if tag is None:
        pointer = root / LATEST_UNIVERSAL
        if not pointer.is_file() or ((root / LATEST).is_file() and not prefer):
            return None
        tag = read_latest_tag(pointer)
    ckpt = root / str(tag)
    return ckpt if is_universal_dir(ckpt) else None


def _zero3_model_files(ckpt: Path) -> list[str]:
    found = {int(m.group(1)): p.name for p in ckpt.iterdir() if (m := _ZERO3_MODEL.match(p.name))}
    names = [found[r] for r in range(len(found)) if r in found]
    if len(names) != len(found):
        raise CheckpointError(f"{ckpt}: stage-3 model files of ranks {sorted(found)}: a rank's file is missing")
    return names


def _state_tensor(path: Path) -> Tensor:
    data = load_torch(path, expected_bytes=None)
    value = data.get("param") if isinstance(data, dict) else data
    if not isinstance(value, Tensor):
        raise CheckpointError(f"{path}: neither a tensor nor a {{\"param\": tensor}} dict (not a universal "
                              "checkpoint's parameter state)")
    return value


def read_universal_layout(ckpt: Path, hint: Manifest) -> DsLayout:
    """The layout of universal tag directory `ckpt`: one saved rank holding every trainable
    parameter of the model file's `param_shapes` whole. `hint`: the model loaded into (tied
    names)."""
    zero3 = [] if (ckpt / DS_MODEL_FILE).is_file() else _zero3_model_files(ckpt)
    model_file = DS_MODEL_FILE if not zero3 else zero3[0]
    model = load_ds(ckpt / model_file)
    groups = model.get("param_shapes") or []
    if not groups:
        raise CheckpointError(f"{ckpt / model_file}: no \"param_shapes\" (not a DeepSpeed save?)")
    zero_stage = 3 if zero3 else int(((model.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0))
    trainable = [(n, tuple(s)) for g in groups for n, s in g.items()]
    frozen = {n: tuple(s) for n, s in (model.get("frozen_param_shapes") or {}).items()}
    if not zero3:  # stages 0-2 list only the frozen parameters the optimizer was given; the module has all
        skip = {n for n, _ in trainable} | set(model.get("buffer_names") or []) | set(model.get("shared_params") or {})
        frozen |= {n: tuple(t.shape) for n, t in (model.get("module") or {}).items() if n not in skip and t.numel()}
    for name, _ in trainable:
        if not (ckpt / ZERO_DIR / name / "fp32.pt").is_file():
            raise CheckpointError(f"{ckpt / ZERO_DIR / name / 'fp32.pt'}: missing; the model file lists {name!r} "
                                  "as trained, so the converter writes its fp32 weights (an incomplete conversion?)")
    precision = _precision(model)
    lp = {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32")
    params = [TensorInfo(n, s, lp, True) for n, s in trainable]
    frozen_saved = all((ckpt / ZERO_DIR / n / "fp32.pt").is_file() for n in frozen) or bool(zero3)
    params += [TensorInfo(n, s, lp, False) for n, s in frozen.items()]
    names = {p.name for p in params}
    aliases = {a: c for a, c in ((model.get("shared_params") or {}) | hint.aliases).items()
               if c in names and a not in names}
    fragments = [[(i, 0, math.prod(s)) for i, (_, s) in enumerate(trainable)]]
    opt = load_ds(ckpt / ZERO_DIR / OPTIMIZER_STATE)
    manifest = _new_manifest(1, zero_stage, precision, params, aliases, _buffers(model),
                             len(opt.get("param_groups") or []), fragments, True, model, ckpt.name)
    manifest.frozen_saved = frozen_saved and bool(frozen)
    files = DsFiles(ckpt=ckpt, model=model_file, zero3_models=zero3, optim=[])
    return DsLayout(files=files, zero_stage=zero_stage, manifest=manifest, locs=[[(0, 0)] * len(trainable)],
                    model=model)


class _PerParam:
    """`optim(0)["master"]` / `["state"]`: entry k read from parameter k's files when asked
    (one parameter's states in memory at a time; the reader asks for each several times)."""

    def __init__(self, reader: "UniversalReader", what: str) -> None:
        self._reader, self._what = reader, what

    def __getitem__(self, k: int) -> Any:
        return self._reader.entry(k)[self._what]

    def __len__(self) -> int:
        return len(self._reader.manifest.fragments[0])


class UniversalReader(DeepSpeedReader):
    """zeroshard's `CheckpointReader` over a universal checkpoint (the run state, buffers and
    client state come from the copied model file, as for a DeepSpeed save)."""

    def __init__(self, layout: DsLayout) -> None:
        super().__init__(layout)
        self._entry: tuple[int, dict[str, Any]] | None = None
        self._opt = load_ds(layout.files.ckpt / ZERO_DIR / OPTIMIZER_STATE)

    def _loss_scaler(self) -> dict[str, Any] | None:
        return loss_scaler_state(self._opt.get("loss_scaler"))

    def _zero3_step(self) -> Any:
        state = ((self._opt.get("optimizer_state_dict") or {}).get("state") or {})
        first = state.get(0) or next(iter(state.values()), {})
        return first.get("step")

    def entry(self, k: int) -> dict[str, Any]:
        """Parameter k's fp32 weights (flat) and optimizer state, from its files."""
        if self._entry is not None and self._entry[0] == k:
            return self._entry[1]
        name = self.names[self.manifest.fragments[0][k][0]]
        where = self.ckpt / ZERO_DIR / name
        numel = self.manifest.fragments[0][k][2]
        master = _state_tensor(where / "fp32.pt").reshape(-1)
        if master.numel() != numel:
            raise CheckpointError(f"{where / 'fp32.pt'}: {master.numel()} elements, the model file says {numel}")
        state: dict[str, Any] = {}
        for key in MOMENTS:
            if (where / f"{key}.pt").is_file():
                state[key] = _state_tensor(where / f"{key}.pt").reshape(-1)
        if state:
            step = load_torch(where / "step.pt", expected_bytes=None) if (where / "step.pt").is_file() \
                else self._zero3_step()
            if step is None:
                raise CheckpointError(f"{where}: optimizer moments without a step (no step.pt, none in "
                                      f"{ZERO_DIR}/{OPTIMIZER_STATE})")
            state["step"] = step if isinstance(step, Tensor) else torch.tensor(float(step))
        self._entry = (k, {"master": master, "state": state})
        return self._entry[1]

    def optim(self, rank: int) -> dict[str, Any]:
        if rank != 0:
            raise CheckpointError(f"{self.ckpt}: a universal checkpoint has one saved rank, asked for {rank}")
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self._opt.get("param_groups") or []]
        n = len(self.manifest.fragments[0])
        return {"master": _PerParam(self, "master"), "state": _PerParam(self, "state"),
                "elementwise": [list(MOMENTS)] * n, "param_groups": groups, "fragments": self.manifest.fragments[0]}

    def weights(self, name: str, offset: int, numel: int, dtype: torch.dtype) -> Tensor:
        info = self.manifest.params[self.index_of[name]]
        if info.trainable:  # the fp32 weights, cast: what DeepSpeed's universal load puts in the model
            master, _ = self.masters(self.master_index(), name, offset, numel, with_state=False)
            return master.to(dtype)
        if not self.layout.files.zero3_models:
            flat = _state_tensor(self.ckpt / ZERO_DIR / name / "fp32.pt").reshape(-1)
        else:  # stage 3: the ranks' pieces, in rank order (the last one padded or cut)
            pieces = []
            for f in self.layout.files.zero3_models:
                frags = self.raw(f).get("frozen_param_fragments") or {}
                if name not in frags:
                    raise CheckpointError(f"{self.ckpt / f}: no frozen_param_fragments[{name!r}]")
                pieces.append(frags[name].reshape(-1))
            flat = torch.cat(pieces)
        return flat[offset : offset + numel].to(dtype, copy=True)


def load_universal(target: EngineState, comm: "Comm", ckpt: Path, *, load_optimizer_states: bool,
                   load_module_only: bool, strict: bool = True) -> LoadedState:
    """Read universal tag directory `ckpt` for this rank; collective (every rank agrees first)."""
    def read() -> tuple[DsLayout, LoadedState]:
        layout = read_universal_layout(ckpt, target.manifest)
        return layout, read_checked(UniversalReader(layout), layout.manifest, ckpt, target,
                                    load_optimizer_states=load_optimizer_states, load_module_only=load_module_only,
                                    strict=strict)

    layout, loaded = read_agreed(comm, "loading the universal checkpoint", f"{ckpt}: DeepSpeed universal checkpoint",
                                 read)
    logger.info(f"loaded DeepSpeed universal checkpoint {ckpt} (converted from a stage-{layout.zero_stage} save)")
    return loaded
