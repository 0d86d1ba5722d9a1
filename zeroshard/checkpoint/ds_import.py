"""DeepSpeed 0.19 checkpoints seen as zeroshard's fragment description: a `Manifest` plus a reader.

A DeepSpeed save is translated, from its own metadata and without copying tensors, into what
zeroshard's format states explicitly: the parameters, and per saved rank the fragments
`(param, offset, numel)` its fp32 master and Adam moments hold (Note: [checkpoint fragments]).
Loading then goes through zeroshard's own path (checkpoint/load.py): the same compatibility
checks, the same range intersection (reshard.py), the same all-ranks-agree-before-apply rule.

Where each layout keeps what (read from DeepSpeed 0.19's files; `ds_files.py` opens them):
- stage 0 (`mp_rank_00_model_states.pt` only): whole weights in `module`; `optimizer` is the
  torch optimizer's state dict (fp32), or for fp16/bf16 `{fp32_groups, optimizer_state_dict,
  cur_scale, ...}`; parameters are numbered in the optimizer's order (the model's trainable
  parameters; checked by shape).
- stages 1/2 and BF16_Optimizer (`[bf16_]zero_pp_rank_R_..._optim_states.pt`): per group,
  one flat fp32 partition per rank (`single_partition_of_fp32_groups`), the moments as one flat
  tensor per group, and `param_slice_mappings` (name -> start, numel in the partition). The
  partitions concatenate in rank order, so a fragment at `start` on rank r sits at flat offset
  `r * partition_numel + start`, and a parameter's first fragment is its first element.
- stage 3 (`zero_pp_rank_R_mp_rank_00_model_states.pt` per rank): each parameter is cut into
  `ceil(numel / world)` elements per rank; rank r's sub-group k (`fp32_flat_groups[k]`, moments
  `state[k]`) is its piece of every parameter of `param_shapes[k]`, in order. Low-precision
  trainable weights are not saved (they are the masters, cast); frozen ones are per-rank pieces
  in `frozen_param_fragments`.
- legacy MoE layers (checkpoint/ds_moe.py): experts in `layer_<L>_expert_<E>_...` files; ZeRO 0
  keeps one optimizer per expert-parallel rank (`expp_rank_R_...`), ZeRO 1/2 cut expert groups
  over expert-data-parallel groups. The manifest names every expert by its global id.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from zeroshard.checkpoint.agreed import read_agreed
from zeroshard.checkpoint.ds_files import (
    DS_MODEL_FILE,
    DsFiles,
    check_parallelism,
    check_slices,
    list_files,
    load_ds,
    loss_scaler_state,
    resolve_ds,
)
from zeroshard.checkpoint.ds_moe import (
    DsExperts,
    Entries,
    expp_name,
    group_ep_sizes,
    match_moe_zero_stage0,
    read_experts,
)
from zeroshard.checkpoint.files import MODEL_FILE
from zeroshard.checkpoint.load import CheckpointReader, read_checked
from zeroshard.checkpoint.reshard import RangeIndex
from zeroshard.checkpoint_format import EngineState, LoadedState, Manifest, Range, TensorInfo, pickle_bytes
from zeroshard.errors import CheckpointError

if TYPE_CHECKING:
    from zeroshard.comm import Comm

logger = logging.getLogger("zeroshard")

_DS_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "data_parallel_sampler_state"})
"""DeepSpeed's own keys of the model file; every other key is the user's `client_state`."""

_OFFLINE = "<no model>"
"""The tag of the stand-in hint `read_layout` builds when converting without a model."""

Loc = tuple[int, int]
"""Where a fragment lives in its rank's optimizer data: (group or sub-group, start)."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class DsLayout:
    """A DeepSpeed checkpoint's content as fragments; `manifest` is zeroshard's view of it."""

    files: DsFiles
    zero_stage: int
    manifest: Manifest
    locs: list[list[Loc]]
    """Per saved rank, aligned with `manifest.fragments[rank]`."""
    frozen_pieces: list[list[Range]] | None = None
    """Stage 3: per rank, the frozen parameters' pieces in `frozen_param_fragments`."""
    model: dict[str, Any] = field(default_factory=dict)
    """The (rank 0) model file."""
    partition_numel: list[int] = field(default_factory=list)
    """Stages 1/2: per group, the elements of one padded partition (the moments DeepSpeed saves
    may hold it whole while the fp32 partition is cut at the parameters' end)."""
    experts: DsExperts | None = None
    """Legacy MoE layers (checkpoint/ds_moe.py): the manifest names every expert by global id."""


# -- building the layout ------------------------------------------------------------------------


def _match_zero_stage0(entries: list[tuple[tuple[int, ...], Tensor | None]], hint: Manifest,
                       module: dict[str, Tensor], path: Path) -> list[str]:
    """Stage 0 stores no names with the optimizer: its k-th parameter (in the optimizer's group
    order) is the first unmatched trainable parameter of the model, in model order, with its
    shape and, when a 16-bit copy is saved, whose saved weight is its fp32 master cast. This
    follows the usual groupings (e.g. no weight decay on 1-D tensors) and, offline, where every
    saved weight is a candidate, skips frozen ones."""
    candidates = [p for p in hint.params if p.trainable]
    used: set[str] = set()
    out = []
    for k, (shape, master) in enumerate(entries):
        for p in candidates:
            if p.name in used or tuple(p.shape) != shape:
                continue
            lp = module.get(p.name)
            if master is not None and lp is not None and not torch.equal(master.to(lp.dtype), lp):
                continue
            used.add(p.name)
            out.append(p.name)
            break
        else:
            raise CheckpointError(f"{path}: the optimizer's parameter {k} (shape {list(shape)}) matches no trainable "
                                  "parameter of the model (a different parameter set, or parameters frozen or "
                                  "regrouped since the save); load with load_optimizer_states=False")
    if hint.tag != _OFFLINE and len(out) != len(candidates):
        rest = [p.name for p in candidates if p.name not in used]
        raise CheckpointError(f"{path}: the optimizer holds {len(out)} parameters, the model has {len(candidates)} "
                              f"trainable ones (not in the checkpoint's optimizer: {rest[:5]}); load with "
                              "load_optimizer_states=False")
    return out


def _module_infos(model: dict[str, Any], trainable: set[str], aliases: dict[str, str]) -> list[TensorInfo]:
    buffers = set(model.get("buffer_names") or [])
    return [TensorInfo(n, tuple(t.shape), _dtype_name(t.dtype), n in trainable)
            for n, t in (model.get("module") or {}).items()
            if n not in buffers and n not in aliases and t.numel() > 0]


def _buffers(model: dict[str, Any]) -> list[TensorInfo]:
    module = model.get("module") or {}
    return [TensorInfo(n, tuple(module[n].shape), _dtype_name(module[n].dtype))
            for n in model.get("buffer_names") or [] if n in module]


def _new_manifest(world: int, zero_stage: int, precision: str, params: list[TensorInfo], aliases: dict[str, str],
                  buffers: list[TensorInfo], groups: int, fragments: list[list[Range]], has_opt: bool,
                  model: dict[str, Any], tag: str) -> Manifest:
    return Manifest(world_size=world, zero_stage=zero_stage, precision=precision, params=params, aliases=aliases,
                    buffers=buffers, optimizer="deepspeed", param_groups=groups, fragments=fragments,
                    weight_pieces=None, frozen_saved=any(not p.trainable for p in params),
                    has_optimizer_states=has_opt, global_steps=int(model.get("global_steps", 0)), tag=tag)


def _precision(model: dict[str, Any]) -> str:
    cfg = model.get("ds_config") or {}
    if (cfg.get("bf16") or cfg.get("bfloat16") or {}).get("enabled"):
        return "bf16"
    if (cfg.get("fp16") or {}).get("enabled"):
        return "fp16"
    return "fp32"


def _zero_stage0_entries(opt: dict[str, Any], path: Path) -> tuple[dict[str, Any], Entries]:
    """(the torch optimizer state dict, (shape, fp32 master or None) per parameter in its order)."""
    inner = opt.get("optimizer_state_dict", opt)
    if "fp32_groups" in opt:
        return inner, [(tuple(t.shape), t) for g in opt["fp32_groups"] for t in g]
    # fp32: the masters are the module's weights; the moments give the optimizer's shapes
    state = inner.get("state", {})
    numbered = [i for g in inner["param_groups"] for i in g["params"]]
    if any("exp_avg" not in state.get(k, {}) for k in numbered):
        raise CheckpointError(f"{path}: optimizer state without exp_avg for some parameters (not an Adam "
                              "state, or saved before the first step); load with load_optimizer_states=False")
    return inner, [(tuple(state[k]["exp_avg"].shape), None) for k in numbered]


def _zero_stage0(files: DsFiles, model: dict[str, Any], hint: Manifest, experts: DsExperts | None = None) -> DsLayout:
    """Stage 0: one source, the model file's optimizer; with MoE layers one per expert-parallel
    rank (`expp_rank_R`), each holding the dense parameters and that rank's experts."""
    path = files.ckpt / files.model
    module = model.get("module") or {}
    aliases = {a: c for a, c in hint.aliases.items() if a in module}
    if experts is None and not isinstance(model.get("optimizer"), dict):
        params = _module_infos(model, {p.name for p in hint.params if p.trainable}, aliases)
        m = _new_manifest(1, 0, _precision(model), params, aliases, _buffers(model), 0, [[]], False, model,
                          files.ckpt.name)
        return DsLayout(files=files, zero_stage=0, manifest=m, locs=[[]], model=model)
    sources: list[list[tuple[str, tuple[int, ...]]]] = []
    for name in files.optim if experts is not None else [files.model]:
        where = files.ckpt / name
        opt = model["optimizer"] if experts is None else load_ds(where).get("optimizer")
        if not isinstance(opt, dict):
            raise CheckpointError(f"{where}: no optimizer state (an MoE checkpoint saved without an optimizer)")
        inner, entries = _zero_stage0_entries(opt, where)
        groups_n = len(inner["param_groups"])
        names = (_match_zero_stage0(entries, hint, module, where) if experts is None
                 else match_moe_zero_stage0(inner, entries, hint, experts, len(sources), where,
                                            lambda e, h, w=where: _match_zero_stage0(e, h, module, w)))
        sources.append([(n, shape) for n, (shape, _) in zip(names, entries, strict=True)])
    trainable = {n for order in sources for n, _ in order}
    params = _module_infos(model, trainable, aliases)
    if experts is not None:
        params += [TensorInfo(n, s, experts.dtypes[n], n in trainable) for n, s in experts.shapes.items()]
    index = {p.name: i for i, p in enumerate(params)}
    missing = [n for n in trainable if n not in index]
    if missing:
        raise CheckpointError(f"{path}: \"module\" lacks trainable parameters {missing[:5]}")
    frags = [[(index[n], 0, math.prod(s)) for n, s in order] for order in sources]
    m = _new_manifest(len(sources), 0, _precision(model), params, aliases, _buffers(model), groups_n, frags, True,
                      model, files.ckpt.name)
    return DsLayout(files=files, zero_stage=0, manifest=m, locs=[[(k, 0) for k in range(len(f))] for f in frags],
                    model=model, experts=experts)


def _group_layout(names: list[str], shapes: dict[str, tuple[int, ...]], param_pads: list[int], world: int,
                  partition_numel: int, path: Path, g: int) -> list[tuple[str, int, int]]:
    """(name, flat offset, numel) of group `g`'s parameters in DeepSpeed's flat buffer: the
    parameters of `param_shapes[g]` in order (DeepSpeed writes them in flat order, round-robin
    reordering included), each followed by its `param_alignment_paddings` zeros; the buffer is
    then zero-padded to a multiple of 2 * world (`nccl_start_alignment_factor` * dp) and cut into
    `world` equal partitions (their size comes from the files, so other paddings read too)."""
    out, pos = [], 0
    for k, n in enumerate(names):
        numel = math.prod(shapes[n])
        out.append((n, pos, numel))
        pos += numel + (param_pads[k] if k < len(param_pads) else 0)
    if pos > partition_numel * world:
        raise CheckpointError(f"{path}: group {g}'s {world} partitions hold {partition_numel} elements each, its "
                              f"parameters need {pos} (with alignment padding): not a ZeRO-1/2 layout zeroshard "
                              "understands (files from different saves?)")
    return out


def _partition_numel(osds: list[dict[str, Any]], g: int, padded_files: bool, path: Path) -> int:
    """The elements of one (padded) partition of group `g`. ZeRO-1/2 saves each rank's partition
    without its alignment padding (`group_paddings[g]` elements cut off its end: the last rank's
    tail, or all of a partition past the parameters); BF16_Optimizer saves it padded."""
    sizes = set()
    for osd in osds:
        numel = osd["single_partition_of_fp32_groups"][g].numel()
        pads = osd.get("group_paddings") or []
        sizes.add(numel if padded_files else numel + int(pads[g] if g < len(pads) else 0))
    if len(sizes) != 1:
        raise CheckpointError(f"{path}: group {g}'s partitions differ in size across ranks ({sorted(sizes)} with "
                              "their group_paddings): files from different saves?")
    return sizes.pop()


def _zero_stage12(files: DsFiles, model: dict[str, Any], hint: Manifest, zero_stage: int,
                  experts: DsExperts | None = None) -> DsLayout:
    world = len(files.optim)
    module = model.get("module") or {}
    path0 = files.ckpt / files.optim[0]
    osds = []
    for name in files.optim:
        osd = load_ds(files.ckpt / name).get("optimizer_state_dict") or {}
        if osd.get("single_partition_of_fp32_groups") is None or osd.get("param_slice_mappings") is None:
            raise CheckpointError(f"{files.ckpt / name}: no single_partition_of_fp32_groups / param_slice_mappings "
                                  "(not a ZeRO-1/2 optimizer file of DeepSpeed 0.19)")
        osds.append(osd)
    group_shapes = model.get("param_shapes") or []
    groups_n = len(osds[0]["single_partition_of_fp32_groups"])
    if len(group_shapes) != groups_n:
        raise CheckpointError(f"{files.ckpt / files.model}: param_shapes lists {len(group_shapes)} groups, "
                              f"{path0} holds {groups_n} (files from different saves?)")
    shapes = {n: tuple(s) for group in group_shapes for n, s in group.items()}
    # ZeRO-1/2 (DeepSpeedZeroOptimizer, which records `zero_stage`) cuts its padding off; the
    # BF16_Optimizer does not. Both name their files bf16_... with bf16.
    padded_files = "zero_stage" not in osds[0]
    # With round_robin_gradients (and no per-parameter padding) DeepSpeed 0.19 computes its
    # param_slice_mappings in the unreordered order while the data is laid out reordered: the
    # addresses are then not where the data is, so they are only checked without it.
    zero_cfg = (model.get("ds_config") or {}).get("zero_optimization") or {}
    check_maps = not zero_cfg.get("round_robin_gradients", False)
    eps = group_ep_sizes(osds, experts, world, path0)
    trainable: dict[str, None] = {}  # ordered set
    rows: list[list[tuple[str, int, int]]] = [[] for _ in range(world)]  # name, param offset, numel
    locs: list[list[Loc]] = [[] for _ in range(world)]
    partition_numel = []
    for g, group in enumerate(group_shapes):
        names, ep = list(group), eps[g]
        size = _partition_numel(osds, g, padded_files, path0)
        partition_numel.append(size)
        pads = list((osds[0].get("param_alignment_paddings") or [[]] * groups_n)[g] or [])
        layout = _group_layout(names, shapes, pads, world // ep, size, path0, g)
        for r in range(world):
            # Rank r holds partition r // ep of its group: r itself for a dense group; for an
            # expert group, its place in its expert-data-parallel group, of its own experts.
            part, mine = r // ep, {}
            for n, off, numel in layout:
                lo, hi = max(off, part * size), min(off + numel, (part + 1) * size)
                full = n if experts is None or ep == 1 else experts.global_name(n, r % ep)
                trainable[full] = None
                if lo < hi:
                    mine[n] = (lo - part * size, hi - lo)
                    rows[r].append((full, lo - off, hi - lo))
                    locs[r].append((g, lo - part * size))
            check_slices(osds[r], g, mine, check_maps, files.ckpt / files.optim[r])
    shapes |= experts.shapes if experts is not None else {}
    for n in trainable:
        if n not in shapes:
            raise CheckpointError(f"{files.ckpt / files.model}: no shape for parameter {n!r}")
    aliases = dict(model.get("shared_params") or {}) or {a: c for a, c in hint.aliases.items() if a in module}
    # frozen_param_shapes is not always written (None with fp32 ZeRO-1): the module has them all.
    buffers = set(model.get("buffer_names") or [])
    frozen = {n: tuple(t.shape) for n, t in module.items()
              if n not in shapes and n not in aliases and n not in buffers and t.numel() > 0}
    frozen |= {n: s for n, s in (experts.shapes if experts is not None else {}).items() if n not in trainable}

    def dtype(n: str) -> str:
        return _dtype_name(module[n].dtype) if n in module else experts.dtypes[n] if experts and n in experts.dtypes \
            else "float32"

    params = [TensorInfo(n, shapes[n], dtype(n), True) for n in trainable]
    params += [TensorInfo(n, s, dtype(n), False) for n, s in frozen.items()]
    index = {p.name: i for i, p in enumerate(params)}
    fragments = [[(index[n], off, numel) for n, off, numel in rank_rows] for rank_rows in rows]
    m = _new_manifest(world, zero_stage, _precision(model), params, aliases, _buffers(model), groups_n, fragments, True,
                      model, files.ckpt.name)
    return DsLayout(files=files, zero_stage=zero_stage, manifest=m, locs=locs, model=model,
                    partition_numel=partition_numel, experts=experts)


def _zero_stage3(files: DsFiles, model: dict[str, Any]) -> DsLayout:
    world = len(files.zero3_models)
    path0 = files.ckpt / files.zero3_models[0]
    sub_groups = model.get("param_shapes") or []
    frozen = {n: tuple(s) for n, s in (model.get("frozen_param_shapes") or {}).items()}
    precision = _precision(model)
    lp = {"bf16": "bfloat16", "fp16": "float16"}.get(precision, "float32")
    params = [TensorInfo(n, tuple(s), lp, True) for g in sub_groups for n, s in g.items()]
    params += [TensorInfo(n, s, lp, False) for n, s in frozen.items()]
    flats = (load_ds(files.ckpt / files.optim[0]).get("optimizer_state_dict") or {}).get("fp32_flat_groups")
    if flats is None or len(flats) != len(sub_groups):
        raise CheckpointError(f"{files.ckpt / files.optim[0]}: {0 if flats is None else len(flats)} fp32 sub-groups, "
                              f"{path0} lists {len(sub_groups)} (files from different saves?)")
    fragments: list[list[Range]] = [[] for _ in range(world)]
    locs: list[list[Loc]] = [[] for _ in range(world)]
    i = 0
    for k, group in enumerate(sub_groups):
        offset = 0
        for shape in group.values():
            numel = math.prod(shape)
            per = math.ceil(numel / world)
            for r in range(world):
                count = min(per, numel - r * per)
                if count > 0:
                    fragments[r].append((i, r * per, count))
                    locs[r].append((k, offset))
            offset += per
            i += 1
        if offset != flats[k].numel():
            raise CheckpointError(f"{files.ckpt / files.optim[0]}: sub-group {k} holds {flats[k].numel()} elements, "
                                  f"its parameters' pieces add up to {offset}: not a layout zeroshard understands")
    frozen_pieces: list[list[Range]] = [[] for _ in range(world)]
    for j, (_name, s) in enumerate(frozen.items()):
        numel, per = math.prod(s), math.ceil(math.prod(s) / world)
        for r in range(world):
            if numel - r * per > 0:
                frozen_pieces[r].append((i + j, r * per, min(per, numel - r * per)))
    aliases = _storage_aliases(model, [p.name for p in params])
    m = _new_manifest(world, 3, precision, params, aliases, _buffers(model), 0, fragments, True, model, files.ckpt.name)
    inner = (load_ds(files.ckpt / files.optim[0]).get("optimizer_state_dict") or {}).get("optimizer_state_dict") or {}
    m.param_groups = len(inner.get("param_groups", []))
    return DsLayout(files=files, zero_stage=3, manifest=m, locs=locs, frozen_pieces=frozen_pieces, model=model)


def _storage_aliases(model: dict[str, Any], names: list[str]) -> dict[str, str]:
    """Module names whose tensor shares its storage with one of `names` (tied parameters: the
    files are memory-mapped, so every saved storage has its own address, empty ones included)."""
    module = model.get("module") or {}
    owner = {module[n].untyped_storage().data_ptr(): n for n in reversed(names) if n in module}
    return {n: owner[t.untyped_storage().data_ptr()] for n, t in module.items()
            if n not in names and t.untyped_storage().data_ptr() in owner}


def _hint_from_module(model: dict[str, Any]) -> Manifest:
    """Without a model (to-fp32): every saved weight is taken as trainable, and names whose
    tensors share storage in the file (torch.save keeps tied tensors tied) as aliases."""
    buffers = set(model.get("buffer_names") or [])
    seen: dict[tuple[int, int], str] = {}
    params, aliases = [], {}
    for n, t in (model.get("module") or {}).items():
        if n in buffers or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            aliases[n] = seen[key]
            continue
        seen[key] = n
        params.append(TensorInfo(n, tuple(t.shape), _dtype_name(t.dtype), True))
    return _new_manifest(1, 0, "", params, aliases, [], 0, [[]], False, model, _OFFLINE)


def read_layout(ckpt: Path, hint: Manifest | None) -> DsLayout:
    """The layout of DeepSpeed tag directory `ckpt`. `hint`: the model being loaded into (stage
    0 numbers parameters by the model's trainable ones; tied names are taken from it); None
    offline, where the model file stands in for it."""
    first = ckpt / DS_MODEL_FILE
    if not first.is_file():
        first = ckpt / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    model = load_ds(first)
    if hint is None:
        hint = _hint_from_module(model)
    check_parallelism(model, first, moe_ok=True)
    world = int(model.get("dp_world_size", 1) or 1)
    zero_stage = int(((model.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0))
    if first.name != DS_MODEL_FILE:
        zero_stage = 3
    files = list_files(ckpt, world, zero_stage)
    experts = read_experts(ckpt, model, zero_stage, ckpt / files.optim[0] if files.optim else None)
    if experts is not None and zero_stage == 0:  # ZeRO 0: one optimizer file per expert-parallel rank
        files = dataclasses.replace(files, optim=[expp_name(r) for r in range(experts.ep_size)])
        for name in files.optim:
            if not (ckpt / name).is_file():
                raise CheckpointError(f"{ckpt / name}: missing; a ZeRO-0 MoE checkpoint saved with ep_size "
                                      f"{experts.ep_size} has one optimizer file per expert-parallel rank")
    return layout_of(files, model, hint, zero_stage, experts)


def layout_of(files: DsFiles, model: dict[str, Any], hint: Manifest, zero_stage: int,
              experts: DsExperts | None = None) -> DsLayout:
    """The layout of the files `files` lists (`model`: their model file's contents)."""
    if zero_stage == 3:
        return _zero_stage3(files, model)
    if zero_stage == 0 and (not files.optim or experts is not None):
        return _zero_stage0(files, model, hint, experts)
    return _zero_stage12(files, model, hint, zero_stage, experts)


# -- reading, through zeroshard's reader -------------------------------------------------------


class DeepSpeedReader(CheckpointReader):
    """zeroshard's `CheckpointReader` over DeepSpeed's files: `optim(rank)` presents rank r's
    fragments as views into the memory-mapped DeepSpeed tensors (no copies), `file(MODEL_FILE)`
    the run state in zeroshard's terms. Resharding and checks are the base class's."""

    def __init__(self, layout: DsLayout) -> None:
        super().__init__(layout.files.ckpt, layout.manifest)
        self.layout = layout
        self._optim: dict[int, dict[str, Any]] = {}
        self._raw: dict[str, dict[str, Any]] = {}

    def raw(self, name: str) -> dict[str, Any]:
        if name not in self._raw:
            self._raw[name] = load_ds(self.ckpt / name)
        return self._raw[name]

    def close(self) -> None:
        self._raw.clear()
        self._optim.clear()
        super().close()

    def file(self, name: str) -> Any:
        if name == MODEL_FILE:
            return self._run_file()
        if name.startswith("rng_state_"):
            return None  # DeepSpeed saves no random generator state
        return self.raw(name)

    def module(self) -> dict[str, Tensor]:
        return self.layout.model.get("module") or {}

    def _run_file(self) -> dict[str, Any]:
        model = self.layout.model
        sched = model.get("lr_scheduler")
        client = {k: v for k, v in model.items() if k not in _DS_KEYS}
        return {"global_steps": int(model.get("global_steps", 0)),
                "global_samples": int(model.get("global_samples", 0)),
                "micro_steps": 0,  # not saved by DeepSpeed; any multiple of the accumulation steps
                "skipped_steps": int(model.get("skipped_steps", 0)),
                "lr_scheduler": pickle_bytes(sched) if sched is not None else None,
                "loss_scaler": self._loss_scaler(), "data_loader": None,
                "client_state": pickle_bytes(client)}

    def _loss_scaler(self) -> dict[str, Any] | None:
        opt = self.layout.model.get("optimizer")
        if self.layout.files.optim:
            osd = self.raw(self.layout.files.optim[0]).get("optimizer_state_dict") or {}
            return loss_scaler_state(osd.get("loss_scaler"))
        return loss_scaler_state(opt) if isinstance(opt, dict) else None

    def _optimizer_parts(self, rank: int) -> tuple[list[Tensor], dict[int, dict[str, Any]], list[dict[str, Any]]]:
        """(flat fp32 tensors per group, moments per group, param_groups) of saved rank `rank`."""
        lay = self.layout
        if lay.zero_stage == 0:  # one tensor per parameter: in the model file, or (MoE) expp_rank_<rank>'s
            opt = lay.model["optimizer"] if not lay.files.optim else self.raw(lay.files.optim[rank])["optimizer"]
            inner = opt.get("optimizer_state_dict", opt)
            if "fp32_groups" in opt:
                flats = [t for g in opt["fp32_groups"] for t in g]
            else:
                flats = [self._saved(self.names[i]) for i, _, _ in lay.manifest.fragments[rank]]
            return flats, inner.get("state", {}), inner["param_groups"]
        osd = self.raw(lay.files.optim[rank]).get("optimizer_state_dict") or {}
        if lay.zero_stage == 3:
            inner = osd.get("optimizer_state_dict") or {}
            return list(osd["fp32_flat_groups"]), inner.get("state", {}), inner.get("param_groups", [])
        base = osd.get("base_optimizer_state") or {}
        if isinstance(base, list):  # zero_optimization.elastic_checkpoint: per group, its state cut at the end
            step = osd.get("base_optimizer_state_step")
            states = {k: ({"step": torch.tensor(float(step))} if step is not None else {}) | dict(g)
                      for k, g in enumerate(base)}
            return list(osd["single_partition_of_fp32_groups"]), states, [{} for _ in base]
        return list(osd["single_partition_of_fp32_groups"]), base.get("state", {}), base.get("param_groups", [])

    def optim(self, rank: int) -> dict[str, Any]:
        if rank in self._optim:
            return self._optim[rank]
        flats, states, groups = self._optimizer_parts(rank)

        def sizes(k: int) -> tuple[int, ...]:
            padded = self.layout.partition_numel
            return (flats[k].numel(), padded[k]) if k < len(padded) else (flats[k].numel(),)

        masters, frag_states, elementwise = [], [], []
        for (_, _, numel), (k, start) in zip(self.manifest.fragments[rank], self.layout.locs[rank], strict=True):
            # A view; `_assemble` copies it into an fp32 tensor (fp32 stage 0: the module's weight).
            masters.append(flats[k].reshape(-1)[start : start + numel])
            state, keys = {}, []
            for key, value in (states.get(k) or {}).items():
                # The moments run over the whole partition (ZeRO-1/2 saves them padded, the fp32 one cut).
                if isinstance(value, Tensor) and value.dim() > 0 and value.numel() in sizes(k):
                    state[key] = value.reshape(-1)[start : start + numel]
                    keys.append(key)
                else:
                    state[key] = value
            frag_states.append(state)
            elementwise.append(sorted(keys))
        groups = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        self._optim[rank] = {"master": masters, "state": frag_states, "elementwise": elementwise,
                             "param_groups": groups, "fragments": self.manifest.fragments[rank]}
        return self._optim[rank]

    def _saved(self, name: str) -> Tensor:
        """The saved weight `name`: in the model's "module", or (an expert) in its expert file."""
        experts = self.layout.experts
        if experts is not None and name in experts.files:
            return self.raw(experts.files[name])[name]
        return self.module()[name]

    def weights(self, name: str, offset: int, numel: int, dtype: torch.dtype) -> Tensor:
        experts = self.layout.experts
        if experts is not None and name in experts.files:
            return self._saved(name).reshape(-1)[offset : offset + numel].to(dtype, copy=True)
        if self.layout.zero_stage != 3:
            return super().weights(name, offset, numel, dtype)
        info = self.manifest.params[self.index_of[name]]
        if info.trainable:  # stage 3 saves no low-precision copy: it is the master, cast
            master, _ = self.masters(self.master_index(), name, offset, numel, with_state=False)
            return master.to(dtype)
        index = RangeIndex(self.layout.frozen_pieces or [], self.names)
        files = self.layout.files.zero3_models

        def piece(source: int, entry: int) -> Tensor:
            frags = self.raw(files[source]).get("frozen_param_fragments") or {}
            i = self.layout.frozen_pieces[source][entry][0]  # type: ignore[index]
            if self.names[i] not in frags:
                raise CheckpointError(f"{self.ckpt / files[source]}: no frozen_param_fragments[{self.names[i]!r}]")
            return frags[self.names[i]]

        return self._assemble(index, piece, self.index_of[name], offset, numel, dtype)


def load_deepspeed(target: EngineState, comm: "Comm", ckpt: Path, *, load_optimizer_states: bool,
                   load_module_only: bool, strict: bool = True) -> LoadedState:
    """Read DeepSpeed tag directory `ckpt` for this rank; collective (every rank agrees first)."""
    def read() -> tuple[DsLayout, LoadedState]:
        layout = read_layout(ckpt, target.manifest)
        return layout, read_checked(DeepSpeedReader(layout), layout.manifest, ckpt, target,
                                    load_optimizer_states=load_optimizer_states, load_module_only=load_module_only,
                                    strict=strict, global_experts=layout.experts is not None)

    layout, loaded = read_agreed(comm, "loading the DeepSpeed checkpoint", f"{ckpt}: DeepSpeed checkpoint", read)
    logger.info(f"loaded DeepSpeed checkpoint {ckpt} (stage {layout.zero_stage}, saved by "
                f"{layout.manifest.world_size} ranks)")
    return loaded


def find_deepspeed(load_dir: str | os.PathLike[str], tag: str | None) -> Path | None:
    """The DeepSpeed tag directory to load, or None when `load_dir`/`tag` is not DeepSpeed's."""
    return resolve_ds(Path(load_dir), tag)
