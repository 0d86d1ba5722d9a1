"""MoE experts under global ids: how a checkpoint saved at one expert-parallel size loads at another.

Each rank saves its own experts under the model's local names: with `ep_size` E and L local
experts per rank, data-parallel rank r holds experts `(r % E) * L .. (r % E) * L + L - 1` of the
layer as `...deepspeed_experts.0 .. L-1` (moe/ep_groups.py: consecutive ranks form an
expert-parallel group). `globalize` rewrites a manifest into global names, every expert of every
MoE layer listed once (`...deepspeed_experts.<g>`) and each rank's fragments pointing at its own
global experts, so the usual range intersection (reshard.py) reads any expert at any layout:
another `ep_size`, world size or ZeRO stage. `own_global_names` renames a loading rank's own
experts the same way. Only the file's names change: the format on disk is the same (a checkpoint
saved before this reads as well). Imports checkpoint_format and errors only.
"""

from __future__ import annotations

import dataclasses
import re

from zeroshard.checkpoint_format import BANKS, Manifest, Range, TensorInfo
from zeroshard.errors import CheckpointError

EXPERT_NAME = re.compile(r"^(?P<prefix>.+\.deepspeed_experts)\.(?P<j>\d+)\.(?P<rest>.+)$")
"""A parameter of one expert of a zeroshard (DeepSpeed legacy) MoE layer: prefix, local index, rest."""


def expert_parallel_size(m: Manifest, where: str) -> int | None:
    """The manifest's one expert-parallel size; None without MoE layers.

    Raises:
        CheckpointError: MoE layers of several expert-parallel sizes (their experts cannot be
            told apart by name, so they are not resharded).
    """
    sizes = set((m.expert_parallel or {}).values())
    if not sizes:
        return None
    if len(sizes) > 1:
        raise CheckpointError(f"{where}: MoE layers of several expert-parallel sizes {m.expert_parallel}; resharding "
                              "them is not built: load at the same world size and ep_size")
    return sizes.pop()


def refuse_moving_banks(m: Manifest, where: str, why: str) -> None:
    """Expert banks saved at an expert-parallel size > 1 cannot be read at another layout yet.

    Raises:
        CheckpointError: `m` holds such banks.
    """
    banks = {k[:-len(BANKS)]: v for k, v in (m.expert_parallel or {}).items() if k.endswith(BANKS) and v > 1}
    if banks:
        raise CheckpointError(
            f"{where}: Hugging Face expert banks cut over {banks} ranks (expert_parallel.autoep_size) and {why}; "
            "reading bank experts at another expert-parallel size or world size is not built yet: resume with "
            f"the same world size ({m.world_size}) and autoep_size")


def experts_move(saved: Manifest, target: Manifest) -> bool:
    """Whether the experts are laid out differently in the checkpoint and in this run.

    Raises:
        CheckpointError: they move, and they include expert banks (`refuse_moving_banks`).
    """
    if not saved.expert_parallel and not target.expert_parallel:
        return False
    moving = saved.expert_parallel != target.expert_parallel or saved.world_size != target.world_size
    if moving:
        why = (f"this run has world size {target.world_size} and expert layout {target.expert_parallel or 'none'} "
               f"(saved: {saved.expert_parallel})")
        refuse_moving_banks(saved, "the checkpoint", why)
        refuse_moving_banks(target, "this run", why)
    return moving


def _local_counts(m: Manifest) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in m.params:
        match = EXPERT_NAME.match(p.name)
        if match:
            counts[match["prefix"]] = max(counts.get(match["prefix"], 0), int(match["j"]) + 1)
    return counts


def _global(name: str, ep_rank: int, counts: dict[str, int]) -> str:
    match = EXPERT_NAME.match(name)
    if not match:
        return name
    return f"{match['prefix']}.{ep_rank * counts[match['prefix']] + int(match['j'])}.{match['rest']}"


def own_global_names(m: Manifest, rank: int, ep_size: int) -> Manifest:
    """`m` with rank `rank`'s own experts renamed to their global ids (same list, same indices)."""
    counts = _local_counts(m)
    params = [dataclasses.replace(p, name=_global(p.name, rank % ep_size, counts)) for p in m.params]
    return dataclasses.replace(m, params=params, expert_parallel=None)


def globalize(m: Manifest, ep_size: int) -> Manifest:
    """`m` with every expert of every MoE layer under its global id, each once (the dense
    parameters first, in their order; then each layer's experts in id order), and each rank's
    fragments renamed to its own experts' ids. `expert_parallel` is cleared: names now say it all.

    Raises:
        CheckpointError: a layer whose local experts differ in their parameters.
    """
    counts = _local_counts(m)
    templates: dict[str, list[TensorInfo]] = {prefix: [] for prefix in counts}
    params: list[TensorInfo] = []
    for p in m.params:
        match = EXPERT_NAME.match(p.name)
        if not match:
            params.append(p)
        elif match["j"] == "0":
            templates[match["prefix"]].append(dataclasses.replace(p, name=match["rest"]))
    for prefix, count in counts.items():
        local = {p.name for p in m.params if p.name.startswith(prefix + ".")}
        rests = [t.name for t in templates[prefix]]
        if local != {f"{prefix}.{j}.{r}" for j in range(count) for r in rests}:
            raise CheckpointError(f"the experts of {prefix} differ in their parameters: cannot lay them out by id")
        for g in range(count * ep_size):
            params += [dataclasses.replace(t, name=f"{prefix}.{g}.{t.name}") for t in templates[prefix]]
    index = {p.name: i for i, p in enumerate(params)}
    fragments: list[list[Range]] = [
        [(index[_global(m.params[i].name, r % ep_size, counts)], off, n) for i, off, n in frags]
        for r, frags in enumerate(m.fragments)]
    pieces = None
    if m.weight_pieces is not None:
        pieces = [[(index[_global(m.params[i].name, r % ep_size, counts)], off, n) for i, off, n in frags]
                  for r, frags in enumerate(m.weight_pieces)]
    aliases = {a: c for a, c in m.aliases.items() if c in index}
    return dataclasses.replace(m, params=params, fragments=fragments, weight_pieces=pieces, aliases=aliases,
                               expert_parallel=None)


def is_expert(name: str) -> bool:
    return EXPERT_NAME.match(name) is not None
