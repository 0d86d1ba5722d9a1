"""`checkpoint.keep_last`: after a publish, remove all but the newest K complete tags of a root.
Imports checkpoint/ only.

A tag counts when it is complete (its manifest exists: Note: [save order] in save.py); tags are
ordered as auto-resume orders them (the manifest's step, then modification time; verify.py's
`candidates`). The tag `latest` names is never removed, nor a directory without a manifest (a
leftover of another tool, or one a user is still filling). A removed tag is first renamed to
`.TAG.pruned` (one atomic rename: a crash mid-removal leaves no half-deleted tag that looks like
a checkpoint), then deleted; leftovers of an earlier crash are deleted on the next prune.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from zeroshard.checkpoint.files import MANIFEST
from zeroshard.checkpoint.manifest import read_latest
from zeroshard.checkpoint.verify import PIPELINE_FILE, candidates
from zeroshard.errors import CheckpointError

logger = logging.getLogger("zeroshard")

PRUNED_SUFFIX = ".pruned"


def prune(root: str | os.PathLike[str], keep_last: int) -> list[str]:
    """Remove all but the `keep_last` newest complete tags under `root`; returns the removed tags.
    Run by the rank that publishes (no collective). `keep_last` 0 keeps everything."""
    root = Path(root)
    if keep_last <= 0 or not root.is_dir():
        return []
    for leftover in root.glob(f".*{PRUNED_SUFFIX}"):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        latest = read_latest(root)
    except CheckpointError:
        latest = None
    complete = [t for t in candidates(root) if (root / t / MANIFEST).is_file() or (root / t / PIPELINE_FILE).is_file()]
    removed = []
    for tag in complete[keep_last:]:
        if tag == latest:
            continue
        doomed = root / f".{tag}{PRUNED_SUFFIX}"
        try:
            os.replace(root / tag, doomed)
            shutil.rmtree(doomed)
        except OSError as e:  # a removal that fails costs disk space, never a checkpoint
            logger.warning(f"checkpoint.keep_last: could not remove {root / tag}: {e}")
            continue
        removed.append(tag)
    if removed:
        logger.info(f"checkpoint.keep_last={keep_last}: removed {', '.join(removed)} from {root}")
    return removed
