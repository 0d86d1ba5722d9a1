"""Is a checkpoint whole? `verify` checks one tag directory; `newest_verified` picks, on every
rank alike, the newest tag of a root that is complete and verified (auto-resume).

Note: [checkpoint checksums] The manifest lists every file's size (`files`) and, since
checksums were added, its crc32 (`checksums`), computed by the rank that wrote the file while
the bytes passed through `torch.save` (checkpoint/files.py), so a save reads nothing back.
crc32 is not a defence against tampering; it finds what happens to checkpoints: a truncated
copy, a file overwritten by another run, flipped bytes. A manifest without `checksums` (saved
by an older zeroshard) is checked by sizes only, silently. Imports comm/, checkpoint/ and
checkpoint_format only.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from zeroshard.checkpoint.agreed import read_agreed
from zeroshard.checkpoint.files import MANIFEST, MODEL_FILE, file_checksum
from zeroshard.checkpoint.manifest import read_manifest
from zeroshard.checkpoint.save import gather_rows
from zeroshard.checkpoint_format import Manifest
from zeroshard.errors import CheckpointError

if TYPE_CHECKING:
    from zeroshard.comm import Comm

logger = logging.getLogger("zeroshard")

PIPELINE_FILE = "pipeline.json"
"""A pipeline checkpoint's tag directory holds this and one zeroshard directory per stage."""

_RANK_OF_FILE = re.compile(r"^(?:zero_pp_rank_|rng_state_)(\d+)[._]")


def _file_rank(name: str) -> int | None:
    match = _RANK_OF_FILE.match(name)
    return int(match.group(1)) if match else None


def verify(tag_dir: str | os.PathLike[str], *, rank: int = 0, world_size: int = 1) -> list[str]:
    """The problems of checkpoint directory `tag_dir`; an empty list when it is whole.

    Checks that the manifest exists and parses, and that every file it lists is present with
    its recorded size and (when the manifest has checksums) crc32. A pipeline checkpoint
    (`pipeline.json`) is checked stage directory by stage directory. With `rank` and
    `world_size`, only every `world_size`-th file from `rank` on is read for its checksum, so
    the ranks of a job share the reading (`newest_verified`); sizes are checked for all.

    Returns:
        One line per problem, each naming the file: "no manifest (...)", "FILE is missing",
        "FILE is N bytes, the manifest says M ...", "FILE has checksum crc32:..., the manifest
        says crc32:... ...".

    Example::

        problems = verify("ckpt/global_step1000")
        if problems:
            print("\\n".join(problems))
    """
    ckpt = Path(tag_dir)
    if not (ckpt / MANIFEST).is_file() and (ckpt / PIPELINE_FILE).is_file():
        pipe_stage_dirs = sorted(p for p in ckpt.iterdir() if p.is_dir() and p.name.startswith("pipe_stage_"))
        if not pipe_stage_dirs:
            return [f"{PIPELINE_FILE} but no pipe_stage_* directory"]
        return [f"{s.name}/{p}" for s in pipe_stage_dirs for p in verify(s, rank=rank, world_size=world_size)]
    if not (ckpt / MANIFEST).is_file():
        return [f"no {MANIFEST} (the manifest is written last: the save did not finish, or it was removed)"]
    try:
        manifest = read_manifest(ckpt)
    except CheckpointError as e:
        return [f"{MANIFEST}: {str(e).removeprefix(f'{ckpt / MANIFEST}: ')}"]
    here = manifest.node_ranks
    problems = []
    for i, (name, size) in enumerate(sorted(manifest.files.items())):
        if here is not None and name != MODEL_FILE and _file_rank(name) not in here:
            continue  # node-local storage: another node's directory holds it
        path = ckpt / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        actual = path.stat().st_size
        if actual != size:
            problems.append(f"{name} is {actual} bytes, the manifest says {size} "
                            "(truncated or replaced after the save)")
            continue
        want = (manifest.checksums or {}).get(name)
        # Node-local storage: each node reads its own directory whole (the share is per job).
        mine = here is not None or i % world_size == rank
        if want is not None and mine:
            got = file_checksum(path)
            if got != want:
                problems.append(f"{name} has checksum {got}, the manifest says {want} (its bytes changed "
                                "after the save)")
    return problems


@dataclass(frozen=True)
class Resumable:
    """The tag `newest_verified` chose, and its manifest (a pipeline's: its first stage's)."""

    tag: str
    path: Path
    manifest: Manifest


def _step_of(ckpt: Path) -> int:
    """The step a tag directory was saved at: its manifest's, else the number its name ends with."""
    for manifest_dir in (ckpt, ckpt / "pipe_stage_00"):
        try:
            return read_manifest(manifest_dir).global_steps
        except (CheckpointError, OSError):
            pass
    match = re.search(r"(\d+)$", ckpt.name)
    return int(match.group(1)) if match else -1


def candidates(root: Path) -> list[str]:
    """Tag directories under `root` that hold checkpoint files, newest first: by saved step, then
    by modification time. Staging (`.TAG.partial`) and retired (`.TAG.old`) directories are not
    tags; directories without a manifest or `.pt`/`.pth` files are not checkpoints."""
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.name.startswith(".") or not d.is_dir():
            continue
        names = {p.name for p in d.iterdir()}
        if MANIFEST in names or PIPELINE_FILE in names or any(n.endswith((".pt", ".pth")) for n in names):
            found.append((_step_of(d), d.stat().st_mtime_ns, d.name))
    return [name for *_, name in sorted(found, reverse=True)]


def _encode(values: list[str]) -> list[int]:
    return list(json.dumps(values).encode("utf-8"))


def _decode(row: list[int]) -> list[str]:
    return json.loads(bytes(row).decode("utf-8")) if row else []


def newest_verified(comm: "Comm", load_dir: str | os.PathLike[str]) -> Resumable | None:
    """The newest tag under `load_dir` that is complete and verified, the same on every rank.

    Rank 0 lists the tags (`candidates`), newest first; for each, every rank checks its share
    of the files (`verify`) and the ranks gather their problems. A tag with a problem is skipped
    with one warning on rank 0 naming it and the first problem. `latest` is not consulted: it
    may name a tag that was damaged after it was written. Collective: every rank calls it.

    Returns:
        The chosen tag, or None when `load_dir` holds no verified checkpoint (or does not exist).
    """
    root = Path(load_dir)
    listing = _encode(candidates(root)) if comm.rank == 0 else []
    tags = _decode(gather_rows(comm, listing)[0])
    for tag in tags:
        problems = verify(root / tag, rank=comm.rank, world_size=comm.world_size)
        gathered = [p for row in gather_rows(comm, _encode(problems)) for p in _decode(row)]
        problems = list(dict.fromkeys(gathered))  # every rank sees the manifest's problems: once each
        if not problems:
            ckpt = root / tag
            manifest_dir = ckpt if (ckpt / MANIFEST).is_file() else ckpt / "pipe_stage_00"
            manifest = read_agreed(comm, "reading the manifest to resume from", manifest_dir,
                                   lambda d=manifest_dir: read_manifest(d))
            return Resumable(tag=tag, path=ckpt, manifest=manifest)
        if comm.rank == 0:
            more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
            logger.warning(f"auto-resume: skipping checkpoint {root / tag}: {problems[0]}{more}")
    return None
