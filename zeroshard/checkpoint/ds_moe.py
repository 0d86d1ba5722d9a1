"""DeepSpeed 0.19's legacy MoE checkpoint files, seen under global expert ids (docs/moe.md).

A save of a model with `deepspeed.moe.layer.MoE` layers keeps the experts out of
`mp_rank_00_model_states.pt` ("module" holds the dense weights and the gates). Each expert's
weights are in `layer_<L>_expert_<E>_mp_rank_00_model_states.pt` (L: the MoE layer's index in
module order, E: the global expert id, parameter names already global). The optimizer state
follows the optimizer's groups: at ZeRO 0, expert-parallel rank R's whole torch state dict (the
dense parameters and its own experts, under local numbering) is `expp_rank_R_..._optim_states.pt`;
at ZeRO 1/2 each rank's `zero_pp_rank_*` file holds the dense groups cut over the data-parallel
ranks and each expert group (`"moe": True`, named `ep_size_<E>`) cut over its
expert-data-parallel group, its slice mappings under local names. With `ep_size` E, rank r is
expert-parallel rank `r % E` (local expert j is global `(r % E) * L + j`, L experts per rank)
and expert-data-parallel rank `r // E`. ds_import.py builds its layouts with global expert names
from these facts; load.py reads them at any expert layout. Imports only checkpoint/ds_files.py,
checkpoint/expert_layout.py, checkpoint_format and errors.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from zeroshard.checkpoint.ds_files import load_ds
from zeroshard.checkpoint.expert_layout import EXPERT_NAME, is_expert
from zeroshard.checkpoint_format import Manifest, TensorInfo
from zeroshard.errors import CheckpointError

Entries = list[tuple[tuple[int, ...], Tensor | None]]
"""Stage 0: per parameter in the optimizer's order, its shape and its fp32 master (None: fp32)."""

_EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt$")
_GROUP_NAME = re.compile(r"^ep_size_(\d+)$")


def expp_name(ep_rank: int) -> str:
    """The ZeRO-0 optimizer file of expert-parallel rank `ep_rank` (written by its first replica)."""
    return f"expp_rank_{ep_rank}_mp_rank_00_optim_states.pt"


@dataclass(frozen=True, slots=True)
class DsExperts:
    """The experts of a DeepSpeed legacy-MoE save: every expert parameter under its global name."""

    ep_size: int
    files: dict[str, str]
    """Global parameter name -> the expert file holding it, in (layer, expert id, parameter) order."""
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    """Global parameter name -> its saved dtype ("float32", "bfloat16")."""
    local_counts: dict[str, int]
    """Module prefix (`...deepspeed_experts`) -> experts per expert-parallel rank."""

    def global_name(self, local: str, ep_rank: int) -> str:
        """Rank `ep_rank`'s local expert parameter name as its global name (others unchanged)."""
        m = EXPERT_NAME.match(local)
        if m is None or m["prefix"] not in self.local_counts:
            return local
        return f"{m['prefix']}.{ep_rank * self.local_counts[m['prefix']] + int(m['j'])}.{m['rest']}"

    def of_rank(self, ep_rank: int) -> list[str]:
        """The global names of expert-parallel rank `ep_rank`'s experts, in the model's order."""
        out = []
        for name in self.files:
            m = EXPERT_NAME.match(name)
            if m is not None and int(m["j"]) // self.local_counts[m["prefix"]] == ep_rank:
                out.append(name)
        return out


def moe_group_sizes(param_groups: list[dict[str, Any]], where: Path) -> list[int | None]:
    """Per optimizer group: the `ep_size` of an expert group, None for a dense one."""
    out: list[int | None] = []
    for g in param_groups:
        m = _GROUP_NAME.match(str(g.get("name", "")))
        if g.get("moe") and m is None:
            raise CheckpointError(f"{where}: an expert parameter group named {g.get('name')!r}, not ep_size_<E>: "
                                  "not a layout of DeepSpeed's legacy MoE that zeroshard can map")
        out.append(int(m[1]) if g.get("moe") and m is not None else None)
    return out


def _refuse_variants(ckpt: Path, model: dict[str, Any], zero_stage: int) -> None:
    if model.get("ds_autoep_layers"):
        raise CheckpointError(f"{ckpt}: an AutoEP checkpoint (ds_autoep_layers: DeepSpeed's AutoEPMoELayer); "
                              "zeroshard reads legacy deepspeed.moe.layer.MoE checkpoints only")
    if zero_stage == 3:
        raise CheckpointError(f"{ckpt}: MoE layers at ZeRO stage 3; zeroshard (like DeepSpeed 0.19.8) does not "
                              "train legacy MoE layers at stage 3, so it has no layout to load it into")


def _ep_size(ckpt: Path, first_optim: Path) -> int:
    """The one `ep_size` of the save, from its expert groups' names (`ep_size_<E>`)."""
    data = load_ds(first_optim)
    if "optimizer" in data:  # ZeRO 0: a torch optimizer's state dict (16-bit: inside DeepSpeed's wrapper's)
        opt = data.get("optimizer") or {}
        groups = opt.get("optimizer_state_dict", opt).get("param_groups") or []
    else:
        base = (data.get("optimizer_state_dict") or {}).get("base_optimizer_state") or {}
        groups = (base.get("param_groups") or []) if isinstance(base, dict) else []
    sizes = {s for s in moe_group_sizes(groups, first_optim) if s is not None}
    if len(sizes) != 1:
        raise CheckpointError(f"{first_optim}: expert parameter groups of sizes {sorted(sizes) or 'none'}; zeroshard "
                              "maps a DeepSpeed MoE checkpoint whose MoE layers share one ep_size and whose experts "
                              "are grouped by split_params_into_different_moe_groups_for_optimizer")
    return sizes.pop()


def _key(name: str) -> tuple[int, int]:
    m = _EXPERT_FILE.match(name)
    if m is None:
        raise AssertionError(f"expected an expert file name, got {name}")
    return int(m[1]), int(m[2])


def read_experts(ckpt: Path, model: dict[str, Any], zero_stage: int, first_optim: Path | None) -> DsExperts | None:
    """The experts of DeepSpeed tag directory `ckpt` (None without MoE layers), checked: each
    layer's experts all present, each file holding one expert's parameters under its own global
    id. `first_optim`: rank 0's ZeRO-1/2 file (None at ZeRO 0: expert-parallel rank 0's file).

    Raises:
        CheckpointError: a variant zeroshard does not map (AutoEP, stage 3, MoE layers of several
            ep_sizes), a missing or inconsistent expert file.
    """
    names = sorted((p.name for p in ckpt.iterdir() if _EXPERT_FILE.match(p.name)), key=_key)
    counts = [int(c) for c in (model.get("num_experts") or [])]
    if not names and not any(counts) and not model.get("ds_autoep_layers"):
        return None
    _refuse_variants(ckpt, model, zero_stage)
    ep_size = _ep_size(ckpt, first_optim if first_optim is not None else ckpt / expp_name(0))
    per_layer: dict[int, list[int]] = {}
    for n in names:
        per_layer.setdefault(_key(n)[0], []).append(_key(n)[1])
    if len(per_layer) != len(counts) or any(per_layer.get(i) != list(range(c)) for i, c in enumerate(counts)):
        found = {k: len(v) for k, v in per_layer.items()}
        raise CheckpointError(f"{ckpt}: the model file lists {counts} experts per MoE layer, the directory holds "
                              f"layer_<L>_expert_<E> files for {found} (layer: experts): expert files missing or "
                              "from another save")
    bad = [c for c in counts if c % ep_size]
    if bad:
        raise CheckpointError(f"{ckpt}: an MoE layer of {bad[0]} experts, not a multiple of ep_size {ep_size}")
    files: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    local: dict[str, int] = {}
    for n in names:
        layer, expert = _key(n)
        for key, t in load_ds(ckpt / n).items():
            m = EXPERT_NAME.match(key)
            if m is None or int(m["j"]) != expert:
                raise CheckpointError(f"{ckpt / n}: holds {key!r}, not a parameter of expert {expert}")
            local[m["prefix"]] = counts[layer] // ep_size
            files[key], shapes[key], dtypes[key] = n, tuple(t.shape), str(t.dtype).removeprefix("torch.")
    return DsExperts(ep_size=ep_size, files=files, shapes=shapes, dtypes=dtypes, local_counts=local)


def group_ep_sizes(osds: list[dict[str, Any]], experts: DsExperts | None, world: int, path: Path) -> list[int]:
    """Per group, the ep_size it is cut by: 1 for a dense group (cut over all `world` ranks), E
    for an expert group (cut over the `world // E` ranks of an expert-data-parallel group)."""
    groups_n = len(osds[0]["single_partition_of_fp32_groups"])
    if experts is None:
        return [1] * groups_n
    base = osds[0].get("base_optimizer_state")
    if not isinstance(base, dict):
        raise CheckpointError(f"{path}: an MoE checkpoint saved with zero_optimization.elastic_checkpoint (its "
                              "param groups are not recorded); zeroshard maps MoE checkpoints saved without it")
    sizes = [s or 1 for s in moe_group_sizes(base.get("param_groups") or [], path)]
    counts = list(osds[0].get("partition_count") or [])
    if len(sizes) != groups_n or any(world % e or (counts and counts[g] != world // e) for g, e in enumerate(sizes)):
        raise CheckpointError(f"{path}: groups of ep_size {sizes} at {world} ranks, partition_count {counts}: not the "
                              "expert-data-parallel partitioning of DeepSpeed's legacy MoE that zeroshard maps")
    return sizes


def match_moe_zero_stage0(inner: dict[str, Any], entries: Entries, hint: Manifest, experts: DsExperts, ep_rank: int,
                          path: Path, match: Callable[[Entries, Manifest], list[str]]) -> list[str]:
    """The names of expert-parallel rank `ep_rank`'s ZeRO-0 optimizer entries: `match` (ds_import's
    stage-0 matcher) of its dense groups against the model's dense parameters, and of its expert
    groups against its own experts under global names (frozen where the model's are)."""
    moe = [size is not None for size, g in zip(moe_group_sizes(inner["param_groups"], path), inner["param_groups"],
                                                strict=True) for _ in g["params"]]
    frozen = {(m["prefix"], m["rest"]) for p in hint.params if not p.trainable and (m := EXPERT_NAME.match(p.name))}
    own = [TensorInfo(n, experts.shapes[n], experts.dtypes[n], True) for n in experts.of_rank(ep_rank)
           if (m := EXPERT_NAME.match(n)) is not None and (m["prefix"], m["rest"]) not in frozen]
    dense = iter(match([e for e, x in zip(entries, moe, strict=True) if not x],
                       dataclasses.replace(hint, params=[p for p in hint.params if not is_expert(p.name)])))
    mine = iter(match([e for e, x in zip(entries, moe, strict=True) if x], dataclasses.replace(hint, params=own)))
    return [next(mine) if x else next(dense) for x in moe]
