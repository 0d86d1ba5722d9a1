"""The manifest (`zeroshard_manifest.json`): JSON form, tag resolution, checks against a model.

A tag directory is complete exactly when its manifest exists: the manifest is written last,
after every rank's files, and lists their sizes. See docs/checkpoints.md for the format.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from zeroshard.checkpoint.files import LATEST, MANIFEST, read_latest_tag, retired_dir
from zeroshard.checkpoint_format import FORMAT_VERSION, Manifest, TensorInfo
from zeroshard.errors import CheckpointError

logger = logging.getLogger("zeroshard")

FORMAT_NAME = "zeroshard-checkpoint"


def to_json(manifest: Manifest) -> str:
    d = dataclasses.asdict(manifest)
    # The JSON keeps the key "stage" for the ZeRO stage (field `zero_stage`): files written before stay readable.
    d = {"format": FORMAT_NAME, "format_version": d.pop("format_version"),
         **{("stage" if k == "zero_stage" else k): v for k, v in d.items()}}
    # One line per parameter, per buffer and per rank's range list: readable, and diffable.
    lines = []
    for key, value in d.items():
        if isinstance(value, list) and value and isinstance(value[0], (dict, list)):
            rows = ",\n  ".join(json.dumps(v) for v in value)
            text = f"[\n  {rows}\n ]"
        else:
            text = json.dumps(value)
        lines.append(f" {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _info(row: dict[str, Any]) -> TensorInfo:
    return TensorInfo(name=str(row["name"]), shape=tuple(int(s) for s in row["shape"]), dtype=str(row["dtype"]),
                      trainable=bool(row.get("trainable", False)))


def from_json(text: str, path: Path) -> Manifest:
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); the manifest is damaged") from e
    if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path}: not a zeroshard checkpoint manifest (no \"format\": \"{FORMAT_NAME}\")")
    version = d.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {version!r}; this zeroshard reads versions <= "
                              f"{FORMAT_VERSION}. Upgrade zeroshard to load it.")
    try:
        pieces = d["weight_pieces"]
        return Manifest(
            world_size=int(d["world_size"]), zero_stage=int(d["stage"]), precision=str(d["precision"]),
            params=[_info(r) for r in d["params"]], aliases={str(k): str(v) for k, v in d["aliases"].items()},
            buffers=[_info(r) for r in d["buffers"]], optimizer=d["optimizer"],
            param_groups=int(d["param_groups"]),
            fragments=[[(int(a), int(b), int(c)) for a, b, c in rank] for rank in d["fragments"]],
            weight_pieces=None if pieces is None else [[(int(a), int(b), int(c)) for a, b, c in rank]
                                                        for rank in pieces],
            frozen_saved=bool(d["frozen_saved"]), has_optimizer_states=bool(d["has_optimizer_states"]),
            global_steps=int(d["global_steps"]), format_version=version, tag=str(d["tag"]),
            files={str(k): int(v) for k, v in d["files"].items()},
            node_ranks=None if d.get("node_ranks") is None else [int(r) for r in d["node_ranks"]],
            checksums=None if d.get("checksums") is None else {str(k): str(v) for k, v in d["checksums"].items()},
            train_batch_size=None if d.get("train_batch_size") is None else int(d["train_batch_size"]),
            expert_parallel=None if d.get("expert_parallel") is None
            else {str(k): int(v) for k, v in d["expert_parallel"].items()},
            expert_banks=None if d.get("expert_banks") is None
            else {str(k): int(v) for k, v in d["expert_banks"].items()})
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: manifest field missing or malformed ({type(e).__name__}: {e})") from e


def read_manifest(ckpt_dir: Path) -> Manifest:
    path = ckpt_dir / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing. {ckpt_dir} is not a complete checkpoint (a save that was interrupted "
            "leaves no manifest), or not a zeroshard checkpoint")
    return from_json(path.read_text(encoding="utf-8"), path)


def read_latest(load_dir: Path) -> str | None:
    path = load_dir / LATEST
    if not path.is_file():
        return None
    return read_latest_tag(path)


def resolve(load_dir: str | os.PathLike[str], tag: str | None) -> tuple[Path, Manifest] | None:
    """The checkpoint directory and manifest for `tag` (None: the one `latest` names).

    Returns None when `tag` is None and `load_dir` has no `latest` file (nothing saved yet).
    """
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory")
    if tag is None:
        tag = read_latest(root)
        if tag is None:
            return None
    ckpt = root / str(tag)
    if not ckpt.is_dir():
        old = retired_dir(root, str(tag))
        if (old / MANIFEST).is_file():
            # A re-save of this tag stopped between its two renames (checkpoint/save.py).
            logger.warning(f"{ckpt} is missing; loading the previous save of tag {tag!r} from {old}")
            ckpt = old
        else:
            known = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
            raise CheckpointError(f"{ckpt}: tag {tag!r} not found in {root}; tags there: {known or 'none'}")
    return ckpt, read_manifest(ckpt)


# -- checks against the model being loaded into ----------------------------------------------


def _names(infos: list[TensorInfo]) -> dict[str, TensorInfo]:
    return {i.name: i for i in infos}


def _listing(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_compatible(saved: Manifest, target: Manifest, path: Path, *, need_optimizer: bool,
                     strict: bool = True) -> None:
    """Raise CheckpointError naming `path` and the first mismatches; nothing is loaded yet.

    `strict=False` (`load_module_strict=False`) lets parameter names be missing on either side:
    the model's parameters the checkpoint lacks keep their values; shapes must still match, and
    optimizer state cannot be restored for a parameter the checkpoint lacks."""
    have, want = _names(saved.params), _names(target.params)
    problems = []
    missing = [n for n, t in want.items() if n not in have and (t.trainable or saved.frozen_saved)]
    unexpected = [n for n, s in have.items() if n not in want and (s.trainable or saved.frozen_saved)]
    shapes = [f"{n}: checkpoint {list(have[n].shape)}, model {list(t.shape)}"
              for n, t in want.items() if n in have and have[n].shape != t.shape]
    if missing and not strict and need_optimizer:
        problems.append(f"parameters of the model missing from the checkpoint: {_listing(missing)} "
                        "have no optimizer state there; load with load_optimizer_states=False")
    elif missing and strict:
        problems.append(f"parameters of the model missing from the checkpoint: {_listing(missing)}")
    if unexpected and strict:
        problems.append(f"parameters in the checkpoint the model lacks: {_listing(unexpected)}")
    if shapes:
        problems.append(f"shape mismatch: {_listing(shapes, 3)}")
    bufs_have, bufs_want = _names(saved.buffers), _names(target.buffers)
    bshapes = [f"{n}: checkpoint {list(bufs_have[n].shape)}, model {list(b.shape)}"
               for n, b in bufs_want.items() if n in bufs_have and bufs_have[n].shape != b.shape]
    if bshapes:
        problems.append(f"buffer shape mismatch: {_listing(bshapes, 3)}")
    if need_optimizer:
        if not saved.has_optimizer_states:
            problems.append("saved without optimizer states; load with load_optimizer_states=False")
        elif saved.param_groups != target.param_groups:
            problems.append(f"optimizer has {target.param_groups} parameter groups, the checkpoint "
                            f"{saved.param_groups}")
        else:
            frozen_then = [n for n, t in want.items() if t.trainable and n in have and not have[n].trainable]
            if frozen_then:
                problems.append(f"parameters frozen when saved (no optimizer state) are trainable now: "
                                f"{_listing(frozen_then)}; load with load_optimizer_states=False")
    problems += _expert_layout_problems(saved, target)
    if problems:
        raise CheckpointError(f"{path}: the checkpoint does not match the model: " + "; ".join(problems))


def _expert_layout_problems(saved: Manifest, target: Manifest) -> list[str]:
    """MoE experts are saved per rank under local names (rank r's expert j is the model's expert
    r * local + j). zeroshard's own checkpoints are read under global expert ids where the layouts
    differ (load.py, checkpoint/expert_layout.py), so this refuses only what has no such ids: a
    checkpoint without experts (DeepSpeed's) loaded into an MoE model, or the reverse."""
    have, want = saved.expert_parallel or {}, target.expert_parallel or {}
    if not have and not want:
        return []
    if have == want and saved.world_size == target.world_size:
        return []
    return [f"the MoE experts were saved by {saved.world_size} rank(s) with expert-parallel sizes {have or 'none'}, "
            f"this run has {target.world_size} rank(s) with {want or 'none'}: the model and the checkpoint differ "
            "in their MoE layers (a checkpoint from another model, or one without zeroshard MoE layers)"]
