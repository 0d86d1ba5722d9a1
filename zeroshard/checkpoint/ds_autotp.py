"""DeepSpeed 0.19 AutoTP checkpoints (`tensor_parallel.autotp_size` > 1) read as one checkpoint in
global parameter names and whole shapes, so any layout loads them (TP 2, TP 1, data-parallel only).

What AutoTP writes at ZeRO 0-2 (DeepSpeed 0.19.8, TP t of `tp`, data-parallel rank d of `dp`):
one `mp_rank_{t:02d}_model_states.pt` per TP rank (its local pieces under the global names,
`param_shapes` local, `mp_world_size` = tp) and, at ZeRO-1/2, one
`zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt` per (d, t): TP rank t's flat ZeRO partitions over
its dp group. Each TP rank's files are therefore a data-parallel DeepSpeed checkpoint of its local
model, which ds_import.py already decodes (`layout_of`); this module reads one per TP rank and
rewrites every fragment of a split parameter's piece as ranges of the whole parameter
(`global_segments`, the rule tensor_parallel/checkpoint.py saves by, in checkpoint_format.py).
Replicated parameters (norms, the embedding AutoTP leaves whole) are taken from TP rank 0. The split
dimension of each parameter is read off the model being loaded (its global shape against the saved
piece's). The load itself is zeroshard's (checkpoint/load.py), resharding to the loading layout.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from zeroshard.checkpoint.agreed import read_agreed
from zeroshard.checkpoint.ds_files import check_parallelism, list_files, load_ds, model_name
from zeroshard.checkpoint.ds_import import DeepSpeedReader, DsLayout, layout_of
from zeroshard.checkpoint.load import read_checked
from zeroshard.checkpoint_format import EngineState, LoadedState, Manifest, Range, TensorInfo, global_segments
from zeroshard.errors import CheckpointError

if TYPE_CHECKING:
    from zeroshard.comm import Comm

logger = logging.getLogger("zeroshard")

Split = tuple[int, tuple[int, ...]] | None
"""(split dim, global shape) of a parameter, or None when every TP rank holds it whole."""
Entry = tuple[int, int, int]
"""Where a global fragment's values are: (entry in the TP rank's fragment list, offset in it, numel)."""


def is_autotp(ckpt: Path) -> bool:
    """A DeepSpeed tag directory with a second model-parallel rank's model file and no layer files
    (DeepSpeed's pipeline checkpoints also write one mp_rank file per stage: checkpoint/ds_pipe.py)."""
    return (ckpt / model_name(1)).is_file() and not any(ckpt.glob("layer_*-model_states.pt"))


def _split_of(name: str, pieces: list[tuple[int, ...]], whole: tuple[int, ...] | None, path: Path) -> Split:
    tp = len(pieces)
    if any(p != pieces[0] for p in pieces):
        raise CheckpointError(f"{path}: {name!r} has pieces of different shapes on the TP ranks ({pieces}); "
                              "zeroshard reads AutoTP splits into equal pieces only")
    piece = pieces[0]
    if whole is None:
        raise CheckpointError(f"{path}: {name!r} is not a parameter of the model being loaded, so its AutoTP split "
                              "is unknown; load into the model the checkpoint was saved from")
    if piece == whole:
        return None
    dims = [d for d in range(len(whole)) if len(piece) == len(whole) and piece[d] * tp == whole[d]
            and all(piece[k] == whole[k] for k in range(len(whole)) if k != d)]
    if len(dims) != 1 or (dims[0] != 0 and not (dims[0] == 1 and len(whole) == 2)):
        raise CheckpointError(f"{path}: {name!r} is saved as {tp} pieces of {list(piece)}, the model's parameter is "
                              f"{list(whole)}: not an AutoTP split of it along rows or columns (another model?)")
    return dims[0], whole


@dataclasses.dataclass
class AutoTpLayout:
    """One `DsLayout` per TP rank, and the global view zeroshard's reader sees."""

    ranks: list[DsLayout]
    splits: dict[str, Split]
    manifest: Manifest
    entries: list[list[tuple[int, Entry]]]
    """Per saved rank `t * dp + d`: (TP rank, where its values are) of each global fragment."""
    module: dict[str, Tensor]


def _global_fragments(ranks: list[DsLayout], splits: dict[str, Split]
                      ) -> tuple[list[list[Range]], list[list[tuple[int, Entry]]]]:
    tp, dp = len(ranks), ranks[0].manifest.world_size
    frags: list[list[Range]] = [[] for _ in range(tp * dp)]
    entries: list[list[tuple[int, Entry]]] = [[] for _ in range(tp * dp)]
    for t, lay in enumerate(ranks):
        names = [p.name for p in lay.manifest.params]
        for d in range(dp):
            out, where = frags[t * dp + d], entries[t * dp + d]
            for j, (i, off, n) in enumerate(lay.manifest.fragments[d]):
                split = splits[names[i]]
                if split is None:
                    if t == 0:  # replicated: TP rank 0's copy
                        out.append((i, off, n))
                        where.append((t, (j, 0, n)))
                    continue
                for g, k, local in global_segments(split[0], split[1], tp, t, off, n):
                    out.append((i, g, k))
                    where.append((t, (j, local, k)))
    return frags, entries


def read_autotp_layout(ckpt: Path, hint: Manifest) -> AutoTpLayout:
    """The AutoTP checkpoint in tag directory `ckpt`, in global terms; `hint`: the model being
    loaded (in global names and shapes), which tells each parameter's split."""
    first = load_ds(ckpt / model_name(0))
    tp = int(first.get("mp_world_size", 1) or 1)
    if tp < 2 or not (ckpt / model_name(tp - 1)).is_file() or (ckpt / model_name(tp)).is_file():
        raise CheckpointError(f"{ckpt / model_name(0)}: mp_world_size {tp}, but the directory holds model files "
                              f"{sorted(p.name for p in ckpt.glob('mp_rank_*_model_states.pt'))}: files from "
                              "different saves?")
    zero_stage = int(((first.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0))
    if zero_stage == 3:
        raise CheckpointError(f"{ckpt}: an AutoTP checkpoint at ZeRO-3; zeroshard reads DeepSpeed's AutoTP files "
                              "at ZeRO stages 0-2 (DeepSpeed 0.19.8 trains AutoTP at those)")
    whole = {p.name: tuple(p.shape) for p in hint.params}
    models = [first] + [load_ds(ckpt / model_name(t)) for t in range(1, tp)]
    ranks = []
    for t, model in enumerate(models):
        path = ckpt / model_name(t)
        check_parallelism(model, path, tp_ok=True)
        mod = model.get("module") or {}
        # The hint in this TP rank's local shapes (stage 0 matches the optimizer's entries by shape).
        local = dataclasses.replace(hint, params=[dataclasses.replace(p, shape=tuple(mod[p.name].shape))
                                                  if p.name in mod else p for p in hint.params])
        world = int(model.get("dp_world_size", 1) or 1)
        ranks.append(layout_of(list_files(ckpt, world, zero_stage, tp_rank=t, tp=tp), model, local, zero_stage))
    base = ranks[0].manifest
    for t, lay in enumerate(ranks[1:], 1):
        if [p.name for p in lay.manifest.params] != [p.name for p in base.params] or \
                lay.manifest.world_size != base.world_size:
            raise CheckpointError(f"{ckpt / model_name(t)}: lists other parameters or another data-parallel size "
                                  f"than {model_name(0)} (files from different saves?)")
    splits = {p.name: _split_of(p.name, [tuple(lay.manifest.params[i].shape) for lay in ranks],
                                whole.get(p.name), ckpt / model_name(0))
              for i, p in enumerate(base.params)}
    params = [p if (s := splits[p.name]) is None else TensorInfo(p.name, s[1], p.dtype, p.trainable)
              for p in base.params]
    frags, entries = _global_fragments(ranks, splits)
    module = dict(first.get("module") or {})
    for name, split in splits.items():
        if split is not None and name in module:
            module[name] = torch.cat([(m.get("module") or {})[name] for m in models], dim=split[0])
    manifest = dataclasses.replace(base, world_size=tp * base.world_size, params=params, fragments=frags)
    return AutoTpLayout(ranks=ranks, splits=splits, manifest=manifest, entries=entries, module=module)


class AutoTpReader(DeepSpeedReader):
    """zeroshard's reader over every TP rank's DeepSpeed files: `optim(t * dp + d)` is TP rank t's
    data-parallel rank d's partition, cut into the global fragments; `module()` the joined weights."""

    def __init__(self, lay: AutoTpLayout) -> None:
        first = lay.ranks[0]
        super().__init__(dataclasses.replace(first, manifest=lay.manifest,
                                             model={**first.model, "module": lay.module}))
        self.tp_layout = lay
        self._subs = [DeepSpeedReader(r) for r in lay.ranks]
        self._dp = first.manifest.world_size

    def close(self) -> None:
        for sub in self._subs:
            sub.close()
        super().close()

    def optim(self, rank: int) -> dict[str, Any]:
        if rank in self._optim:
            return self._optim[rank]
        t0 = rank // self._dp
        src = self._subs[t0].optim(rank % self._dp)
        masters, states, keys = [], [], []
        for t, (j, local, n) in self.tp_layout.entries[rank]:
            if t != t0:
                raise AssertionError(f"expected saved rank {rank}'s fragments from TP rank {t0}, got {t}")
            ek = src["elementwise"][j]
            masters.append(src["master"][j][local : local + n])
            states.append({k: (v[local : local + n] if k in ek else v) for k, v in src["state"][j].items()})
            keys.append(ek)
        self._optim[rank] = {"master": masters, "state": states, "elementwise": keys,
                             "param_groups": src["param_groups"], "fragments": self.manifest.fragments[rank]}
        return self._optim[rank]


def load_autotp(target: EngineState, comm: "Comm", ckpt: Path, *, load_optimizer_states: bool,
                load_module_only: bool, strict: bool = True) -> LoadedState:
    """Read the AutoTP tag directory `ckpt` for this rank, in `target`'s (global) terms; collective."""
    def read() -> tuple[AutoTpLayout, LoadedState]:
        lay = read_autotp_layout(ckpt, target.manifest)
        return lay, read_checked(AutoTpReader(lay), lay.manifest, ckpt, target,
                                 load_optimizer_states=load_optimizer_states, load_module_only=load_module_only,
                                 strict=strict)

    lay, loaded = read_agreed(comm, "loading the DeepSpeed AutoTP checkpoint", f"{ckpt}: DeepSpeed AutoTP checkpoint",
                              read)
    logger.info(f"loaded DeepSpeed AutoTP checkpoint {ckpt} (stage {lay.ranks[0].zero_stage}, TP {len(lay.ranks)} x "
                f"DP {lay.ranks[0].manifest.world_size})")
    return loaded
