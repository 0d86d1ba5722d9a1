"""Pipeline checkpoints: their layout file, global names, and reading them into any layout.

Note: [pipeline checkpoint layout] A pipeline checkpoint `save_dir/tag/` holds
    pipe_stage_SS/                 pipeline rank SS's ZeRO checkpoint (zeroshard's format and manifest,
                                   over that stage's data-parallel ranks)
    layer_XX-model_states.pt       DeepSpeed's per-layer weights (global layer index XX)
    pipeline.json                  the stage layout: stage count, layer boundaries, tie keys
Every parameter is named by its global layer index (`"3.fc.weight"`) or, for a tied layer, by its
tie key (`"tied_modules.embed.weight"`), as DeepSpeed's PipelineModule names them, so the names do
not depend on the stage count. A load gathers, for each parameter this rank holds, the stage
directory that saved it (any of them for a tie held on several stages: the values are equal)
and reads its ranges through the usual reader (checkpoint/load.py): another pipeline degree,
data-parallel degree or ZeRO stage, and a model without a pipeline, all load with their
optimizer state.

Note: [plain names of a pipeline] A model trained without a pipeline is "the same layers in a
`torch.nn.Sequential`": layer i's parameters are `"i.<name>"`, a tied module lives at the first
layer of its key (`tied_modules.embed.weight` <-> `0.weight`). `PipelineModule.to_sequential()`
builds that model. DeepSpeed offers no such mapping (its pipeline checkpoints load only into the
same PipelineModule layout, or weights only with `load_module_only=True`).

Imports checkpoint/, checkpoint_format and comm (a type) only. The stage layout comes in as a
`PipeLayout`, not as the PipelineModule.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from zeroshard.checkpoint.agreed import read_agreed
from zeroshard.checkpoint.files import LATEST, read_latest_tag
from zeroshard.checkpoint.load import CheckpointReader, ExpertReader, read_checked
from zeroshard.checkpoint.manifest import read_manifest
from zeroshard.checkpoint_format import EngineState, LoadedState, Manifest, TensorInfo
from zeroshard.errors import CheckpointError

if TYPE_CHECKING:
    from zeroshard.comm import Comm

PIPELINE_FILE = "pipeline.json"
TIED_PREFIX = "tied_modules."


def stage_dir(stage: int, model_rank: int | None = None) -> str:
    """A stage's state directory; with Megatron-style tensor parallelism (pieces the script split, no
    global names to map them to) each tensor-parallel rank's pieces have a directory of their own."""
    return f"pipe_stage_{stage:02d}" if model_rank is None else f"pipe_stage_{stage:02d}-model_{model_rank:02d}"


def layer_file(idx: int, model_rank: int | None = None) -> str:
    """DeepSpeed's per-layer file name; under tensor parallelism one file per tp rank holding its pieces
    (`layer_03-model_01-model_states.pt`, DeepSpeed's name under a model axis)."""
    if model_rank is None:
        return f"layer_{idx:02d}-model_states.pt"
    return f"layer_{idx:02d}-model_{model_rank:02d}-model_states.pt"


@dataclass(frozen=True)
class PipeLayout:
    """How a PipelineModule is cut: what `pipeline.json` records and a load needs."""

    num_stages: int
    parts: list[int]
    """Layer boundaries of each stage (chunk): stage s holds layers [parts[s], parts[s + 1])."""
    virtual_stages: int = 1
    tied: dict[str, list[int]] = field(default_factory=dict)
    """Tie key -> the global layer indices built from it."""
    num_layers: int = 0
    tp_size: int = 1
    """Megatron-style tensor-parallel ranks whose pieces each stage saved in a directory per rank
    (`stage_dir(s, model_rank)`); 1 for stages saved whole or by AutoTP under global names."""
    partition: Callable[[int], list[int]] | None = field(default=None, compare=False, repr=False)
    """The loading model's layer boundaries at a given stage count (reads DeepSpeed's checkpoints,
    which record none); not saved."""

    def to_json(self) -> str:
        return json.dumps({"format": "zeroshard-pipeline", "num_stages": self.num_stages, "parts": self.parts,
                           "virtual_stages": self.virtual_stages, "tied": self.tied,
                           "num_layers": self.num_layers or self.parts[-1], "model_parallel": self.tp_size})

    @classmethod
    def from_json(cls, text: str, path: Path) -> PipeLayout:
        try:
            d = json.loads(text)
            return cls(num_stages=int(d["num_stages"]), parts=[int(p) for p in d["parts"]],
                       virtual_stages=int(d.get("virtual_stages", 1)),
                       tied={str(k): [int(i) for i in v] for k, v in (d.get("tied") or {}).items()},
                       num_layers=int(d.get("num_layers", d["parts"][-1])),
                       tp_size=int(d.get("model_parallel", 1)))
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: not a pipeline layout file ({type(e).__name__}: {e})") from e


# -- names (Note: [plain names of a pipeline]) -----------------------------------------------------


def pipeline_to_plain(name: str, tied: Mapping[str, Sequence[int]]) -> str:
    """`tied_modules.<key>.rest` -> `<first layer of key>.rest`; other names are the same."""
    if name.startswith(TIED_PREFIX):
        key, _, rest = name[len(TIED_PREFIX):].partition(".")
        if key in tied and tied[key]:
            return f"{min(tied[key])}.{rest}"
    return name


def plain_to_pipeline(name: str, tied: Mapping[str, Sequence[int]]) -> str:
    """`<layer>.rest` of a tied layer -> `tied_modules.<key>.rest`; other names are the same."""
    head, _, rest = name.partition(".")
    if head.isdigit():
        for key, layers in tied.items():
            if int(head) in layers:
                return f"{TIED_PREFIX}{key}.{rest}"
    return name


# -- reading several checkpoints as one ------------------------------------------------------------


@dataclass
class Source:
    """One saved directory's reader, and its names in the target's name space (saved -> target)."""

    reader: CheckpointReader
    rename: Callable[[str], str]


class MultiReader:
    """The reader interface of checkpoint/load.py (`weights`, `masters`, `module`, `optim`, `file`)
    over several saved directories, each parameter read from the directory that saved it.
    `primary` answers the per-checkpoint questions (run state, random generators, param groups)."""

    def __init__(self, sources: list[Source], primary: int, path: Path, want: set[str] | None = None) -> None:
        self.sources, self.primary, self.ckpt = sources, sources[primary].reader, path
        self.progress = None
        self._owner: dict[str, tuple[int, str]] = {}
        params: list[TensorInfo] = []
        buffers: dict[str, TensorInfo] = {}
        for k, s in enumerate(sources):
            for p in s.reader.manifest.params:
                name = s.rename(p.name)
                if name not in self._owner and (want is None or name in want):
                    self._owner[name] = (k, p.name)
                    params.append(TensorInfo(name, p.shape, p.dtype, p.trainable))
            for b in s.reader.manifest.buffers:
                name = s.rename(b.name)
                if want is None or name in want:
                    buffers.setdefault(name, TensorInfo(name, b.shape, b.dtype, b.trainable))
        m = self.primary.manifest
        self.manifest = Manifest(
            world_size=m.world_size, zero_stage=m.zero_stage, precision=m.precision, params=params, aliases={},
            buffers=list(buffers.values()), optimizer=m.optimizer, param_groups=m.param_groups,
            fragments=[[] for _ in range(m.world_size)], weight_pieces=None,
            frozen_saved=all(s.reader.manifest.frozen_saved for s in sources),
            has_optimizer_states=all(s.reader.manifest.has_optimizer_states for s in sources),
            global_steps=m.global_steps, tag=m.tag)
        self.names = [p.name for p in params]
        self.index_of = self.manifest.param_index()

    def _src(self, name: str) -> tuple[CheckpointReader, str, int]:
        if name not in self._owner:
            raise CheckpointError(f"{self.ckpt}: no stage of the checkpoint saved parameter {name!r}")
        k, saved = self._owner[name]
        return self.sources[k].reader, saved, k

    def weights(self, name: str, offset: int, numel: int, dtype: torch.dtype) -> Tensor:
        reader, saved, _ = self._src(name)
        return reader.weights(saved, offset, numel, dtype)

    def master_index(self, prefer: int | None = None) -> list[Any]:
        return [s.reader.master_index(prefer=prefer) for s in self.sources]

    def masters(self, index: list[Any], name: str, offset: int, numel: int,
                with_state: bool = True) -> tuple[Tensor, dict[str, Any]]:
        reader, saved, k = self._src(name)
        return reader.masters(index[k], saved, offset, numel, with_state=with_state)

    def module(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for s in self.sources:
            for n, t in s.reader.module().items():
                out.setdefault(s.rename(n), t)
        return out

    def optim(self, rank: int) -> dict[str, Any]:
        return self.primary.optim(rank)

    def file(self, name: str) -> Any:
        return self.primary.file(name)

    def close(self) -> None:
        for s in self.sources:
            s.reader.close()


def pipeline_sources(root: Path, layout: PipeLayout, rename: Callable[[str], str],
                     model_rank: int | None = None) -> list[Source]:
    """One source per saved pipeline rank's directory (zeroshard's pipeline format); under
    Megatron-style tensor parallelism, the directories of tensor-parallel rank `model_rank`."""
    if layout.tp_size > 1 and model_rank is None:
        raise CheckpointError(f"{root}: its stages were saved as {layout.tp_size} Megatron-style "
                              "tensor-parallel pieces without global names; load it into the same pipeline and "
                              "tensor-parallel layout")
    out = []
    for s in range(layout.num_stages):
        ckpt = root / stage_dir(s, model_rank if layout.tp_size > 1 else None)
        saved = read_manifest(ckpt)
        # A stage with MoE layers saved its experts per rank under local names: read under global
        # ids (Note: [experts in pipeline checkpoints]).
        reader = ExpertReader(ckpt, saved) if saved.expert_parallel else CheckpointReader(ckpt, saved)
        out.append(Source(reader, rename))
    return out


def read_pipe_layout(root: Path) -> PipeLayout | None:
    path = root / PIPELINE_FILE
    return PipeLayout.from_json(path.read_text(), path) if path.is_file() else None


def find_pipeline(load_dir: str | os.PathLike[str], tag: str | None) -> tuple[Path, PipeLayout] | None:
    """The zeroshard pipeline checkpoint `load_dir/tag` names, or None when it is not one (or is
    missing: the ordinary load then reports that)."""
    try:
        ckpt = resolve_tag(load_dir, tag)
    except CheckpointError:
        return None
    layout = read_pipe_layout(ckpt) if ckpt is not None else None
    return (ckpt, layout) if ckpt is not None and layout is not None else None


def resolve_tag(load_dir: str | os.PathLike[str], tag: str | None) -> Path | None:
    """`load_dir/tag` (None: the tag `latest` names); None when there is no `latest`."""
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory")
    if tag is None:
        if not (root / LATEST).is_file():
            return None
        tag = read_latest_tag(root / LATEST)
    ckpt = root / str(tag)
    if not ckpt.is_dir():
        known = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        raise CheckpointError(f"{ckpt}: tag {tag!r} not found in {root}; tags there: {known or 'none'}")
    return ckpt


def read_through(multi: MultiReader, target: EngineState, *, load_optimizer_states: bool, load_module_only: bool,
                 strict: bool) -> LoadedState:
    """This rank's state from `multi` (load.py's `read_checked` over several saved directories).

    Note: [experts in pipeline checkpoints] Each stage's directory is a ZeRO checkpoint over that
    stage's data-parallel ranks; a stage with MoE layers saved each rank's experts under local
    names (checkpoint/expert_layout.py). Its source reads them under global expert ids
    (`ExpertReader`), the combined manifest lists every expert once, and this rank reads its own
    experts by id (`global_experts`), whatever expert-parallel size, data-parallel degree or ZeRO
    stage wrote them."""
    experts = any(isinstance(s.reader, ExpertReader) for s in multi.sources)
    return read_checked(multi, multi.manifest, multi.ckpt, target, load_optimizer_states=load_optimizer_states,
                        load_module_only=load_module_only, strict=strict, global_experts=experts)


def load_pipeline_into_plain(target: EngineState, comm: Comm, ckpt: Path, layout: PipeLayout, *,
                             load_optimizer_states: bool, load_module_only: bool, strict: bool) -> LoadedState:
    """A pipeline checkpoint into a model without a pipeline (Note: [plain names of a pipeline]);
    collective over `comm` (the engine's data-parallel group)."""
    def read() -> LoadedState:
        sources = pipeline_sources(ckpt, layout, lambda n: pipeline_to_plain(n, layout.tied))
        return read_through(MultiReader(sources, 0, ckpt), target, load_optimizer_states=load_optimizer_states,
                            load_module_only=load_module_only, strict=strict)

    return read_agreed(comm, "loading the pipeline checkpoint", ckpt, read)
