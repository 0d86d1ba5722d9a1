"""MoE experts under global ids: how a checkpoint saved at one expert-parallel size loads at another.

Each rank saves its own experts under the model's local names: with `ep_size` E and L local
experts per rank, data-parallel rank r holds experts `(r % E) * L .. (r % E) * L + L - 1` of the
layer as `...deepspeed_experts.0 .. L-1` (moe/ep_groups.py: consecutive ranks form an
expert-parallel group). `globalize` rewrites a manifest into global names, every expert of every
MoE layer listed once (`...deepspeed_experts.<g>`) and each rank's fragments pointing at its own
global experts, so the usual range intersection (reshard.py) reads any expert at any layout:
another `ep_size`, world size or ZeRO stage. `own_global_names` renames a loading rank's own
experts the same way. Hugging Face expert banks (AutoEP) keep one name: a bank parameter is one
tensor of every expert-parallel rank's rows (`Manifest.expert_banks`), and each rank's ranges move
to its rows' place in it. Only the file's names change: the format on disk is the same (a
checkpoint saved before this reads as well). Imports checkpoint_format and errors only.
"""

from __future__ import annotations

import dataclasses
import re

from zeroshard.checkpoint_format import Manifest, Range, TensorInfo
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


def experts_move(saved: Manifest, target: Manifest) -> bool:
    """Whether the experts are laid out differently in the checkpoint and in this run."""
    if not saved.expert_parallel and not target.expert_parallel:
        return False
    return saved.expert_parallel != target.expert_parallel or saved.world_size != target.world_size


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


def _banks(m: Manifest, ep_size: int) -> dict[int, tuple[tuple[int, ...], int]]:
    """Parameter index of each expert-bank parameter -> (its whole shape, its numel on one rank).

    Raises:
        CheckpointError: a bank whose rows times `ep_size` are not its experts.
    """
    out = {}
    for i, p in enumerate(m.params):
        experts = (m.expert_banks or {}).get(p.name)
        if experts is not None:
            if not p.shape or p.shape[0] * ep_size != experts:
                raise CheckpointError(f"expert bank {p.name!r}: {p.shape[0] if p.shape else 0} rows per rank at "
                                      f"ep_size {ep_size} do not make its {experts} experts")
            out[i] = ((experts, *p.shape[1:]), p.numel)
    return out


def bank_bases(m: Manifest, rank: int, ep_size: int) -> dict[str, int]:
    """Where rank `rank`'s rows of each expert-bank parameter start in the whole flattened tensor."""
    return {m.params[i].name: (rank % ep_size) * numel for i, (_, numel) in _banks(m, ep_size).items()}


def _shifted(ranges: list[Range], banks: dict[int, tuple[tuple[int, ...], int]], ep_rank: int,
             index_of: dict[int, int] | None = None) -> list[Range]:
    """Ranges of one rank with each expert-bank offset moved to the rank's rows of the whole tensor
    (and, with `index_of`, parameter indices renumbered)."""
    return [((index_of or {}).get(i, i), off + ep_rank * banks[i][1] if i in banks else off, n)
            for i, off, n in ranges]


def own_global_names(m: Manifest, rank: int, ep_size: int) -> Manifest:
    """`m` with rank `rank`'s own experts renamed to their global ids (same list, same indices) and
    its expert-bank ranges moved to its rows of each whole bank (shapes stay this rank's: where its
    whole parameters start is `bank_bases`)."""
    counts = _local_counts(m)
    banks = _banks(m, ep_size)
    params = [dataclasses.replace(p, name=_global(p.name, rank % ep_size, counts)) for p in m.params]
    fragments = [list(f) for f in m.fragments]
    fragments[rank] = _shifted(m.fragments[rank], banks, rank % ep_size)
    pieces = None
    if m.weight_pieces is not None:
        pieces = [list(f) for f in m.weight_pieces]
        pieces[rank] = _shifted(m.weight_pieces[rank], banks, rank % ep_size)
    return dataclasses.replace(m, params=params, fragments=fragments, weight_pieces=pieces, expert_parallel=None)


def globalize(m: Manifest, ep_size: int) -> Manifest:
    """`m` with every expert of every MoE layer under its global id, each once (the dense
    parameters first, in their order; then each layer's experts in id order), and each rank's
    fragments renamed to its own experts' ids. `expert_parallel` is cleared: names now say it all.

    Raises:
        CheckpointError: a layer whose local experts differ in their parameters.
    """
    counts = _local_counts(m)
    banks = _banks(m, ep_size)
    templates: dict[str, list[TensorInfo]] = {prefix: [] for prefix in counts}
    params: list[TensorInfo] = []
    for i, p in enumerate(m.params):
        match = EXPERT_NAME.match(p.name)
        if i in banks:  # one tensor of every rank's rows
            params.append(dataclasses.replace(p, shape=banks[i][0]))
        elif not match:
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

    def moved(ranges: list[Range], r: int) -> list[Range]:
        return _shifted(ranges, banks, r % ep_size,
                        {i: index[_global(m.params[i].name, r % ep_size, counts)] for i, _, _ in ranges})

    fragments: list[list[Range]] = [moved(frags, r) for r, frags in enumerate(m.fragments)]
    pieces = None if m.weight_pieces is None else [moved(frags, r) for r, frags in enumerate(m.weight_pieces)]
    aliases = {a: c for a, c in m.aliases.items() if c in index}
    return dataclasses.replace(m, params=params, fragments=fragments, weight_pieces=pieces, aliases=aliases,
                               expert_parallel=None, expert_banks=None)


def is_expert(name: str, m: Manifest | None = None) -> bool:
    """A legacy expert's parameter, or (given the checkpoint's manifest `m`) an expert-bank one."""
    return EXPERT_NAME.match(name) is not None or (m is not None and name in (m.expert_banks or {}))
