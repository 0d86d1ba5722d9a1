"""`PipelineCheckpointer`: the `Checkpointer` of a pipeline engine, and pipeline checkpoints opened offline.

Writes Note: [pipeline checkpoint layout] (checkpoint/pipe_files.py) and reads any checkpoint of the
same layers into this engine's stage: zeroshard's pipeline format at any stage count, zeroshard's
format without a pipeline, DeepSpeed's pipeline files (checkpoint/ds_pipe.py). Imports checkpoint/,
checkpoint_format, errors and comm (a type), never runtime/.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor

from zeroshard.checkpoint.agreed import agree, agree_found, read_agreed
from zeroshard.checkpoint.ds_pipe import deepspeed_pipeline_sources, is_deepspeed_pipeline, offline_deepspeed_pipeline
from zeroshard.checkpoint.expert_layout import expert_parallel_size, globalize
from zeroshard.checkpoint.files import LATEST, MANIFEST, save_torch, write_text_atomic
from zeroshard.checkpoint.load import CheckpointReader
from zeroshard.checkpoint.manifest import read_manifest
from zeroshard.checkpoint.pipe_files import (
    PIPELINE_FILE,
    MultiReader,
    PipeLayout,
    Source,
    layer_file,
    pipeline_sources,
    pipeline_to_plain,
    plain_to_pipeline,
    read_pipe_layout,
    read_through,
    resolve_tag,
    stage_dir,
)
from zeroshard.checkpoint.verify import Resumable, newest_verified
from zeroshard.checkpoint_format import EngineState, LoadedState, Manifest
from zeroshard.errors import CheckpointError

if TYPE_CHECKING:
    from zeroshard.comm import Comm


class StageCheckpointer(Protocol):
    """What saves one stage's ZeRO state (a ShardedCheckpointer over the stage's data-parallel group)."""

    def save(self, state: EngineState, save_dir: str, tag: str, client_state: Mapping[str, Any] | None,
             save_latest: bool, save_optimizer_states: bool) -> str: ...


class PipelineCheckpointer:
    """The `Checkpointer` of a pipeline engine (Note: [pipeline checkpoint layout]).

    Args:
        inner: the sharded checkpointer over this stage's data-parallel group.
        world_comm: collectives over every rank (the stages agree on success).
        layout: this engine's stage layout and ties.
        stage_id / dp_rank: this rank's pipeline and data-parallel coordinates.
        layer_states: (global layer index, state dict) of each layer this rank holds with a state,
            written as DeepSpeed's `layer_XX-model_states.pt` by each stage's first data-parallel rank.
        tp_rank: this rank's tensor-parallel coordinate when the model is split over tp (3D): the
            layer files then hold its pieces under DeepSpeed's model-axis name. None without tp.
            With AutoTP, `inner` runs over the stage's dp x tp ranks and this checkpointer sits
            inside tensor_parallel/checkpoint.py's, so everything it sees is already in global names.
    """

    def __init__(self, inner: StageCheckpointer, world_comm: Comm, layout: PipeLayout, stage_id: int, dp_rank: int,
                 layer_states: Callable[[], list[tuple[int, dict[str, Tensor]]]], tp_rank: int | None = None) -> None:
        self._inner, self._world = inner, world_comm
        self.layout, self._stage, self._dp_rank = layout, stage_id, dp_rank
        self._layer_states = layer_states
        self._tp_rank = tp_rank
        # Megatron-style pieces (layout.tp_size > 1) have no global names: one directory per tp rank.
        self._model_rank = tp_rank if layout.tp_size > 1 else None

    def save(self, state: EngineState, save_dir: str, tag: str, client_state: Mapping[str, Any] | None,
             save_latest: bool, save_optimizer_states: bool = True) -> str:
        root = Path(save_dir) / tag
        self._inner.save(state, str(root), stage_dir(self._stage, self._model_rank), client_state, False,
                         save_optimizer_states)
        error = None
        try:
            if self._dp_rank == 0:
                for idx, sd in self._layer_states():
                    save_torch(root / layer_file(idx, self._tp_rank), sd)
        except (OSError, RuntimeError) as e:
            error = f"writing the layer files into {root}: {e}"
        agree(self._world, error, "writing the pipeline's layer files")
        if self._world.rank == 0:
            try:
                write_text_atomic(root / PIPELINE_FILE, self.layout.to_json())
                if save_latest:
                    write_text_atomic(Path(save_dir) / LATEST, tag)
            except OSError as e:
                error = f"{root / PIPELINE_FILE}: {e}"
        agree(self._world, error, "publishing the pipeline checkpoint")
        return str(root)

    def load(self, target: EngineState, load_dir: str, tag: str | None, *, load_optimizer_states: bool,
             load_module_only: bool, strict: bool = True) -> LoadedState | None:
        def read() -> LoadedState | None:
            ckpt = resolve_tag(load_dir, tag)
            if ckpt is None:
                return None
            ep = expert_parallel_size(target.manifest, "this run")  # experts are read by global id
            listed = globalize(target.manifest, ep) if ep else target.manifest
            multi = self._reader(ckpt, {p.name for p in listed.params} | {b.name for b in listed.buffers})
            return read_through(multi, target, load_optimizer_states=load_optimizer_states,
                                load_module_only=load_module_only, strict=strict)

        loaded = read_agreed(self._world, "loading the pipeline checkpoint", load_dir, read)
        agree_found(self._world, loaded is not None, load_dir)
        return loaded

    def newest_verified(self, load_dir: str | os.PathLike[str]) -> Resumable | None:
        """Auto-resume: the newest tag under `load_dir` whose every stage directory is complete and
        verified, agreed over the whole world (checkpoint/verify.py checks `pipeline.json`'s stage
        directories). Collective."""
        return newest_verified(self._world, load_dir)

    def _reader(self, ckpt: Path, want: set[str]) -> MultiReader:
        """The saved directories of `ckpt`, whatever wrote it, as one reader in this layout's names."""
        saved = read_pipe_layout(ckpt)
        if saved is not None:  # zeroshard, any pipeline layout
            if saved.num_layers != self.layout.num_layers:
                raise CheckpointError(f"{ckpt}: saved from a model of {saved.num_layers} layers, this PipelineModule "
                                      f"has {self.layout.num_layers}; a pipeline checkpoint loads into the same layers")
            if saved.tied != self.layout.tied:
                raise CheckpointError(f"{ckpt}: tied layers {saved.tied} when saved, {self.layout.tied} now")
            if saved.tp_size != self.layout.tp_size:
                raise CheckpointError(
                    f"{ckpt}: saved as {saved.tp_size} Megatron-style tensor-parallel pieces per stage, this "
                    f"engine has {self.layout.tp_size}; pieces a script split itself load into the same "
                    "tensor-parallel degree only (AutoTP checkpoints, keyed by global names, reshard)")
            sources = pipeline_sources(ckpt, saved, lambda n: n, self._model_rank)
            return MultiReader(sources, min(self._stage, len(sources) - 1), ckpt, want)
        if (ckpt / MANIFEST).is_file():  # zeroshard, no pipeline (Note: [plain names of a pipeline])
            reader = CheckpointReader(ckpt, read_manifest(ckpt))
            return MultiReader([Source(reader, lambda n: plain_to_pipeline(n, self.layout.tied))], 0, ckpt, want)
        sources = deepspeed_pipeline_sources(ckpt, self.layout)
        return MultiReader(sources, min(self._stage, len(sources) - 1), ckpt, want)


def open_pipeline(root: Path, tag: str | None) -> tuple[Path, Manifest, Callable[[], Any]] | None:
    """For to-fp32: a pipeline checkpoint (zeroshard's or DeepSpeed's) as the tag directory, its
    manifest in the names of the model without a pipeline, and how to open a reader; None when
    `root`/`tag` is not a pipeline checkpoint."""
    if tag is None and ((root / PIPELINE_FILE).is_file() or is_deepspeed_pipeline(root)):
        ckpt: Path | None = root
    else:
        try:
            ckpt = resolve_tag(root, tag)
        except CheckpointError:
            return None
    if ckpt is None:
        return None
    layout = read_pipe_layout(ckpt)
    if layout is not None:
        def reader() -> MultiReader:
            return MultiReader(pipeline_sources(ckpt, layout, lambda n: pipeline_to_plain(n, layout.tied)), 0, ckpt)

        return ckpt, reader().manifest, reader
    if is_deepspeed_pipeline(ckpt):
        return offline_deepspeed_pipeline(ckpt)
    return None
