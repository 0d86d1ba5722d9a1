"""Checkpoints of a tensor-parallel model keyed by global parameter names, so a load reshards across
tensor-parallel degrees (TP 2 -> 1 -> 4) as it already does across data-parallel sizes and stages.

`TensorParallelCheckpointer` wraps the sharded checkpointer (which then runs over the whole world):
before a save, every range of a split parameter's local piece is rewritten as ranges of the whole
(global) parameter (a column split is one contiguous range; a row split of a [out, in] weight is
one range per row), the manifest lists the global shapes, and rank 0's model file gets the whole
weights (gathered over tp). A load asks for the same global ranges and joins what comes back into
the local pieces. Imports torch, checkpoint_format (the format and the Checkpointer protocol) and
tensor_parallel/ only.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from zeroshard.checkpoint_format import (
    Checkpointer,
    EngineState,
    LoadedState,
    Range,
    Segment,
    TensorInfo,
    global_segments,
)
from zeroshard.tensor_parallel.tp_plan import TensorParallelState

__all__ = ["Segment", "TensorParallelCheckpointer", "global_segments"]  # global_segments: checkpoint_format.py

class TensorParallelCheckpointer:
    """A `Checkpointer` for a model split over tp: global names, shapes and ranges on disk.

    Args:
        inner: the sharded checkpointer over the whole world (its comm's rank is the world rank).
        tp: the model's tensor-parallel state (`shard_model`).
        world_rank / world_size: this rank in the world, and the world's size.
    """

    def __init__(self, inner: Checkpointer, tp: TensorParallelState, world_rank: int, world_size: int) -> None:
        self._inner, self._tp = inner, tp
        self._rank, self._world = world_rank, world_size

    # -- local <-> global ---------------------------------------------------------------

    def _split_ranges(self, ranges: list[Range], params: list[TensorInfo]) -> tuple[list[Range], list[list[Segment]]]:
        out: list[Range] = []
        segs: list[list[Segment]] = []
        for param, offset, numel in ranges:
            name = params[param].name
            if name in self._tp.split:
                dim, shape = self._tp.split[name]
                s = global_segments(dim, shape, self._tp.size, self._tp.comm.rank, offset, numel)
            else:
                s = [(offset, numel, 0)]
            segs.append(s)
            out.extend((param, g, n) for g, n, _ in s)
        return out, segs

    def _to_global(self, state: EngineState) -> tuple[EngineState, list[list[Segment]], list[list[Segment]]]:
        m = state.manifest
        params = [dataclasses.replace(p, shape=self._tp.split[p.name][1]) if p.name in self._tp.split else p
                  for p in m.params]
        frags, fsegs = self._split_ranges(m.fragments[state.rank], m.params)
        masters, states, keys = [], [], []
        for master, st, ek, segs in zip(state.masters, state.optimizer_states, state.elementwise_keys, fsegs):
            for _, n, local in segs:
                masters.append(master[local : local + n])
                states.append({k: (v[local : local + n] if k in ek else v) for k, v in st.items()})
                keys.append(ek)
        psegs: list[list[Segment]] = []
        pieces: list[Tensor] = []
        weight_pieces = None
        if m.weight_pieces is not None:
            pranges, psegs = self._split_ranges(m.weight_pieces[state.rank], m.params)
            weight_pieces = [pranges if r == self._rank else [] for r in range(self._world)]
            pieces = [data[local : local + n] for data, segs in zip(state.weight_pieces, psegs) for _, n, local in segs]
        module = dict(state.module)
        for name in sorted(n for n in module if n in self._tp.split):  # the same order on every tp rank
            module[name] = self._tp.full(name, module[name])
        manifest = dataclasses.replace(m, world_size=self._world, params=params, weight_pieces=weight_pieces,
                                       fragments=[frags if r == self._rank else [] for r in range(self._world)])
        out = dataclasses.replace(state, rank=self._rank, manifest=manifest, masters=masters,
                                  optimizer_states=states, elementwise_keys=keys, module=module, weight_pieces=pieces)
        return out, fsegs, psegs

    @staticmethod
    def _join(values: list[Any], segs: list[list[Segment]]) -> list[Any]:
        out, i = [], 0
        for s in segs:
            part = values[i : i + len(s)]
            i += len(s)
            out.append(part[0] if len(part) == 1 else (None if any(p is None for p in part) else torch.cat(part)))
        return out

    @staticmethod
    def _join_states(states: list[dict[str, Any]], segs: list[list[Segment]]) -> list[dict[str, Any]]:
        out, i = [], 0
        for s in segs:
            part = states[i : i + len(s)]
            i += len(s)
            if len(part) == 1:
                out.append(part[0])
                continue
            lengths = [n for _, n, _ in s]
            merged = {}
            for key, value in part[0].items():
                elementwise = all(isinstance(p.get(key), Tensor) and p[key].dim() > 0 and p[key].numel() == n
                                  for p, n in zip(part, lengths))
                merged[key] = torch.cat([p[key].reshape(-1) for p in part]) if elementwise else value
            out.append(merged)
        return out

    # -- Checkpointer ---------------------------------------------------------------------

    def save(self, state: EngineState, save_dir: str | os.PathLike[str], tag: str,
             client_state: Mapping[str, Any] | None, save_latest: bool, save_optimizer_states: bool = True) -> str:
        glob, _, _ = self._to_global(state)
        return self._inner.save(glob, str(save_dir), tag, client_state, save_latest, save_optimizer_states)

    def newest_verified(self, load_dir: str | os.PathLike[str]) -> Any:
        """Auto-resume: the inner checkpointer's choice (the files are checked in global names, so
        any layout reads them). Collective."""
        return self._inner.newest_verified(load_dir)

    def load(self, target: EngineState, load_dir: str | os.PathLike[str], tag: str | None, *,
             load_optimizer_states: bool, load_module_only: bool, strict: bool = True) -> LoadedState | None:
        glob, fsegs, psegs = self._to_global(dataclasses.replace(target, module={}))
        glob = dataclasses.replace(glob, module=target.module)
        loaded = self._inner.load(glob, str(load_dir), tag, load_optimizer_states=load_optimizer_states,
                                  load_module_only=load_module_only, strict=strict)
        if loaded is None:
            return None
        module = {n: (self._tp.piece(n, v).contiguous() if n in self._tp.split else v)
                  for n, v in loaded.module.items()}
        masters = self._join(loaded.masters, fsegs) if loaded.masters is not None else None
        states = self._join_states(loaded.optimizer_states, fsegs) if loaded.optimizer_states is not None else None
        pieces = self._join(loaded.weight_pieces, psegs) if loaded.weight_pieces is not None else None
        return dataclasses.replace(loaded, module=module, masters=masters, optimizer_states=states,
                                   weight_pieces=pieces)
