"""Reading a checkpoint into this rank's layout, at any world size and stage (resharding).

Note: [no partial load] Loading reads and checks everything this rank needs into fresh CPU
tensors first; the ranks then agree that every rank succeeded, and only then does the engine
copy anything into the model (runtime/checkpoint_state.apply_state). A bad file or a mismatched
model raises CheckpointError on every rank and leaves the engine untouched.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from zeroshard.checkpoint.agreed import agree_found, read_agreed
from zeroshard.checkpoint.expert_layout import (
    bank_bases,
    expert_parallel_size,
    experts_move,
    globalize,
    is_expert,
    own_global_names,
)
from zeroshard.checkpoint.files import MANIFEST, MODEL_FILE, load_torch, optim_file, pieces_file, rng_file
from zeroshard.checkpoint.manifest import check_compatible, resolve
from zeroshard.checkpoint.reshard import RangeIndex
from zeroshard.checkpoint_format import EngineState, LoadedState, Manifest, Range, unpickle_bytes
from zeroshard.errors import CheckpointError
from zeroshard.progress import PROGRESS_MIN_BYTES, Progress

if TYPE_CHECKING:
    from zeroshard.comm import Comm

logger = logging.getLogger("zeroshard")


class CheckpointReader:
    """Opens the files of one checkpoint directory lazily (memory-mapped) and checks each
    against the manifest: size, and the fragment list it claims to hold."""

    def __init__(self, ckpt: Path, manifest: Manifest, prefer: int | None = None) -> None:
        self.ckpt, self.manifest = ckpt, manifest
        self.prefer = prefer
        """The loading rank: where several saved ranks hold a range, read its own file."""
        self._open: dict[str, Any] = {}
        self.progress: Progress | None = None
        """Advanced by each file opened (large checkpoints, rank 0)."""
        self.names = [p.name for p in manifest.params]
        self.index_of = manifest.param_index()

    def file(self, name: str) -> Any:
        if name not in self._open:
            if name not in self.manifest.files:
                raise CheckpointError(f"{self.ckpt / MANIFEST}: lists no file {name}")
            here = self.manifest.node_ranks
            if here is not None and not (self.ckpt / name).is_file():
                raise CheckpointError(
                    f"{self.ckpt / name}: not in this directory. The checkpoint was saved with "
                    f"checkpoint.use_node_local_storage, so this node's directory holds the files of "
                    f"ranks {here} only, and this load (another world size, stage or layout) also "
                    f"needs other nodes' files. Copy the {self.ckpt.name}/ directory of every node "
                    "into one directory and load from there.")
            data = load_torch(self.ckpt / name, expected_bytes=self.manifest.files[name])
            if not isinstance(data, dict):
                raise CheckpointError(f"{self.ckpt / name}: not a zeroshard checkpoint file (a {type(data).__name__})")
            self._open[name] = data
            if self.progress is not None:
                self.progress.advance(self.manifest.files[name], name)
        return self._open[name]

    def close(self) -> None:
        self._open.clear()  # drops the memory maps

    def optim(self, rank: int) -> dict[str, Any]:
        name = optim_file(rank)
        data = self.file(name)
        want = [list(r) for r in self.manifest.fragments[rank]]
        if [list(r) for r in data.get("fragments", [])] != want or len(data.get("master", [])) != len(want):
            raise CheckpointError(f"{self.ckpt / name}: holds other fragments than the manifest lists "
                                  "for it (a file from another checkpoint?)")
        return data

    def pieces(self, rank: int) -> list[Tensor]:
        name = pieces_file(rank)
        data = self.file(name).get("pieces")
        pieces = self.manifest.weight_pieces
        if not isinstance(data, list) or pieces is None or len(data) != len(pieces[rank]):
            raise CheckpointError(f"{self.ckpt / name}: holds other pieces than the manifest lists")
        return data

    def module(self) -> dict[str, Tensor]:
        module = self.file(MODEL_FILE).get("module")
        if not isinstance(module, dict):
            raise CheckpointError(f"{self.ckpt / MODEL_FILE}: no \"module\" state dict")
        return module

    def _assemble(self, index: RangeIndex, get: Any, param: int, offset: int, numel: int, dtype: torch.dtype) -> Tensor:
        out = torch.empty(numel, dtype=dtype)
        for r in index.reads(param, offset, numel):
            src = get(r.source, r.entry).reshape(-1)
            out[r.dst_offset : r.dst_offset + r.numel].copy_(src[r.src_offset : r.src_offset + r.numel])
        return out

    def weights(self, name: str, offset: int, numel: int, dtype: torch.dtype) -> Tensor:
        """Elements `[offset, offset + numel)` of a saved parameter's low-precision values."""
        m = self.manifest
        if m.weight_pieces is None:
            module = self.module()
            if name not in module:
                raise CheckpointError(f"{self.ckpt / MODEL_FILE}: no tensor {name!r} in \"module\"")
            flat = module[name].reshape(-1)
            if flat.numel() < offset + numel:
                raise CheckpointError(f"{self.ckpt / MODEL_FILE}: {name!r} has {flat.numel()} elements, "
                                      f"the manifest says {m.params[self.index_of[name]].numel}")
            return flat[offset : offset + numel].to(dtype, copy=True)
        index = RangeIndex(m.weight_pieces, self.names, prefer=self.prefer)
        return self._assemble(index, lambda s, e: self.pieces(s)[e], self.index_of[name], offset, numel, dtype)

    def master_index(self, prefer: int | None = None) -> RangeIndex:
        return RangeIndex(self.manifest.fragments, self.names, prefer=prefer)

    def masters(self, index: RangeIndex, name: str, offset: int, numel: int,
                with_state: bool = True) -> tuple[Tensor, dict[str, Any]]:
        """fp32 master and (`with_state`) optimizer state of `[offset, offset + numel)` of `name`."""
        param = self.index_of[name]
        reads = index.reads(param, offset, numel)
        master = self._assemble(index, lambda s, e: self.optim(s)["master"][e], param, offset, numel, torch.float32)
        state: dict[str, Any] = {}
        if not reads or not with_state:
            return master, state
        first = self.optim(reads[0].source)
        keys = set(first["state"][reads[0].entry])
        elementwise = list(first["elementwise"][reads[0].entry])
        for r in reads[1:]:
            if set(self.optim(r.source)["state"][r.entry]) != keys:
                raise CheckpointError(f"{self.ckpt}: fragments of {name!r} hold different optimizer state keys")
        for key in keys:
            if key in elementwise:
                dtype = first["state"][reads[0].entry][key].dtype
                state[key] = self._assemble(index, lambda s, e, k=key: self.optim(s)["state"][e][k],
                                            param, offset, numel, dtype)
            else:
                value = first["state"][reads[0].entry][key]
                state[key] = value.clone() if isinstance(value, Tensor) else value
        return master, state


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in the manifest")
    return dtype


class ExpertReader(CheckpointReader):
    """A checkpoint with MoE experts, read under global expert ids (checkpoint/expert_layout.py):
    the rank files keep their local names; the reader translates. An expert's weights are its
    fp32 master cast: the model file holds rank 0's experts only."""

    def __init__(self, ckpt: Path, saved: Manifest, prefer: int | None = None) -> None:
        ep = expert_parallel_size(saved, str(ckpt / MANIFEST)) or 1
        super().__init__(ckpt, globalize(saved, ep), prefer=prefer)
        self._local = saved
        self._index: RangeIndex | None = None

    def optim(self, rank: int) -> dict[str, Any]:
        data = self.file(optim_file(rank))
        want = [list(r) for r in self._local.fragments[rank]]
        if [list(r) for r in data.get("fragments", [])] != want or len(data.get("master", [])) != len(want):
            raise CheckpointError(f"{self.ckpt / optim_file(rank)}: holds other fragments than the manifest lists "
                                  "for it (a file from another checkpoint?)")
        return {**data, "fragments": self.manifest.fragments[rank]}

    def weights(self, name: str, offset: int, numel: int, dtype: torch.dtype) -> Tensor:
        if not is_expert(name, self._local):
            return super().weights(name, offset, numel, dtype)
        if not self.manifest.params[self.index_of[name]].trainable or not self.manifest.has_optimizer_states:
            raise CheckpointError(f"{self.ckpt}: expert parameter {name!r} is frozen or saved without optimizer "
                                  "states, so only its saving rank holds it: load at the same world size and ep_size")
        if self._index is None:
            self._index = self.master_index(self.prefer)
        master, _ = self.masters(self._index, name, offset, numel, with_state=False)
        return master.to(dtype)


def _read_by_global_ids(reader: Any, target: EngineState, where: Path, need_opt: bool, load_module_only: bool,
                        strict: bool) -> LoadedState:
    """This rank's state from `reader`, whose manifest names every expert by its global id (a
    zeroshard checkpoint through ExpertReader, DeepSpeed's MoE files): the model is checked under
    global ids too, and this rank reads its own experts by id; closes the reader."""
    tm, rank = target.manifest, target.rank
    ep = expert_parallel_size(tm, "this run") or 1
    try:
        check_compatible(reader.manifest, globalize(tm, ep), where, need_optimizer=need_opt, strict=strict)
        own = own_global_names(tm, rank, ep)
        local_of = {g.name: p.name for g, p in zip(own.params, tm.params, strict=True)}
        loaded = _read_files(reader, dataclasses.replace(target, manifest=own), reader.manifest, need_opt,
                             load_module_only, rank, bases=bank_bases(tm, rank, ep))
    finally:
        reader.close()
    return dataclasses.replace(loaded, module={local_of.get(k, k): v for k, v in loaded.module.items()})


def _read_moving_experts(target: EngineState, ckpt: Path, saved: Manifest, need_opt: bool, load_module_only: bool,
                         strict: bool) -> LoadedState:
    """`_read` when the experts are laid out otherwise than saved (another ep_size or world size):
    both sides under global expert ids, this rank reading its own experts by id."""
    reader = ExpertReader(ckpt, saved, prefer=target.rank)
    return _read_by_global_ids(reader, target, ckpt / MANIFEST, need_opt, load_module_only, strict)


def _read(target: EngineState, ckpt: Path, saved: Manifest, *, load_optimizer_states: bool,
          load_module_only: bool, strict: bool = True) -> LoadedState:
    tm, rank = target.manifest, target.rank
    need_opt = load_optimizer_states and not load_module_only
    if experts_move(saved, tm):
        return _read_moving_experts(target, ckpt, saved, need_opt, load_module_only, strict)
    check_compatible(saved, tm, ckpt / MANIFEST, need_optimizer=need_opt, strict=strict)
    reader = CheckpointReader(ckpt, saved, prefer=rank)
    total = sum(saved.files.values())
    # Files this rank reads are known only as it reads them: the bar's total is the whole checkpoint.
    reader.progress = Progress(total, f"load {ckpt.name}", rank == 0 and total >= PROGRESS_MIN_BYTES, unit="B")
    try:
        return _read_files(reader, target, saved, need_opt, load_module_only, rank)
    finally:
        reader.progress.close()
        reader.close()


def read_checked(reader: Any, saved: Manifest, where: Path, target: EngineState, *, load_optimizer_states: bool,
                 load_module_only: bool, strict: bool, global_experts: bool = False) -> LoadedState:
    """This rank's state from `reader` (any object with CheckpointReader's reading methods: a
    zeroshard directory, several as one, DeepSpeed's files), checked against `target` before
    anything is read (Note: [no partial load]); closes the reader. `global_experts`: `saved`
    names MoE experts by global id (DeepSpeed's MoE files), read at any expert layout."""
    need_opt = load_optimizer_states and not load_module_only
    if global_experts and target.manifest.expert_parallel:
        return _read_by_global_ids(reader, target, where, need_opt, load_module_only, strict)
    try:
        check_compatible(saved, target.manifest, where, need_optimizer=need_opt, strict=strict)
        return _read_files(reader, target, saved, need_opt, load_module_only, target.rank)
    finally:
        reader.close()


def _read_files(reader: CheckpointReader, target: EngineState, saved: Manifest, need_opt: bool,
                load_module_only: bool, rank: int, bases: dict[str, int] | None = None) -> LoadedState:
    """`bases`: where this rank's whole parameters start in the checkpoint's tensor of that name
    (its rows of an expert bank, checkpoint/expert_layout.py::bank_bases); 0 for the others."""
    tm = target.manifest
    have = {p.name for p in saved.params if p.trainable or saved.frozen_saved}
    module: dict[str, Tensor] = {}
    if tm.weight_pieces is None:  # this run holds whole parameters
        for p in tm.params:
            if p.name in have:
                base = (bases or {}).get(p.name, 0)
                module[p.name] = reader.weights(p.name, base, p.numel, _dtype(p.dtype)).view(p.shape)
    weight_pieces = None
    if tm.weight_pieces is not None:
        # None keeps the piece's current values (a frozen parameter the checkpoint left out).
        weight_pieces = [reader.weights(tm.params[i].name, off, n, _dtype(tm.params[i].dtype))
                         if tm.params[i].name in have else None for i, off, n in tm.weight_pieces[rank]]
    saved_module = reader.module()
    for b in tm.buffers:
        if b.name not in saved_module:
            raise CheckpointError(f"{reader.ckpt / MODEL_FILE}: no buffer {b.name!r} (the model has it)")
        module[b.name] = saved_module[b.name].to(_dtype(b.dtype), copy=True).view(b.shape)
    masters = states = groups = None
    if need_opt:
        masters, states = _read_masters(reader, tm.fragments[rank], tm, rank)
        # Every rank saved the same param_groups: read this rank's own file when it has one
        # (with node-local storage, rank 0's file may be on another node).
        own = rank < saved.world_size and (saved.node_ranks is None or rank in saved.node_ranks)
        groups = [dict(g) for g in reader.optim(rank if own else 0)["param_groups"]]
    model = reader.file(MODEL_FILE)
    run_state = rng = client_state = None
    if not load_module_only:
        run_state = {k: model.get(k) for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps",
                                                "lr_scheduler", "loss_scaler", "data_loader")}
        rng = _read_rng(reader, rank)
        if model.get("client_state") is not None:
            client_state = unpickle_bytes(model["client_state"])
    return LoadedState(path=str(reader.ckpt), module=module, weight_pieces=weight_pieces, masters=masters,
                       optimizer_states=states, param_groups=groups, run_state=run_state, rng=rng,
                       client_state=client_state)


def _read_masters(reader: CheckpointReader, wanted: list[Range], tm: Manifest,
                  rank: int) -> tuple[list[Tensor], list[dict[str, Any]]]:
    index = reader.master_index(prefer=rank)
    masters, states = [], []
    for i, off, n in wanted:
        master, state = reader.masters(index, tm.params[i].name, off, n)
        masters.append(master)
        states.append(state)
    return masters, states


def _read_rng(reader: CheckpointReader, rank: int) -> dict[str, Any] | None:
    if rank >= reader.manifest.world_size:
        logger.info(f"rank {rank}: the checkpoint was saved by {reader.manifest.world_size} ranks and has no "
                    "random generator state for this rank; its generators keep their current state")
        return None
    rng = reader.file(rng_file(rank))
    return rng


def load_state(target: EngineState, comm: "Comm", load_dir: str | os.PathLike[str], tag: str | None, *,
               load_optimizer_states: bool, load_module_only: bool, strict: bool = True) -> LoadedState | None:
    """Read the checkpoint for this rank; collective. None when `load_dir` has no `latest`.

    `strict=False`: parameter names may differ (see `check_compatible`)."""
    def read() -> LoadedState | None:
        resolved = resolve(load_dir, tag)
        if resolved is None:
            return None
        ckpt, saved = resolved
        return _read(target, ckpt, saved, load_optimizer_states=load_optimizer_states,
                     load_module_only=load_module_only, strict=strict)

    loaded = read_agreed(comm, "loading the checkpoint", load_dir, read)
    agree_found(comm, loaded is not None, load_dir)
    return loaded
