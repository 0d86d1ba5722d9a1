"""`checkpoint.keep_last`: after a publish, remove all but the newest K complete tags of a root.
Imports checkpoint/ only.

A tag counts when it is complete (its manifest exists: Note: [save order] in save.py); tags are
ordered as auto-resume orders them (the manifest's step, then modification time; verify.py's
`candidates`). The tag `latest` names is never removed, nor a directory without a manifest (a
leftover of another tool, or one a user is still filling). A removed tag is first renamed to
`.TAG.pruned` (one atomic rename: a crash mid-removal leaves no half-deleted tag that looks like
a checkpoint), then deleted; leftovers of an earlier crash are deleted on the next prune.

The deleting itself (unlinking gigabytes of files: milliseconds to seconds of kernel time) runs on
a `Deleter`'s thread when the caller passes one, so a periodic save does not pay for the one it
retires: measured at world size 1 on bench/async_save.py's model, 13 ms of the 34 ms an
asynchronous `save_checkpoint` blocked. The rename stays on the caller's thread, so which tags
exist is decided before `prune` returns.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

from zeroshard.checkpoint.files import MANIFEST
from zeroshard.checkpoint.manifest import read_latest
from zeroshard.checkpoint.verify import PIPELINE_FILE, candidates
from zeroshard.errors import CheckpointError

logger = logging.getLogger("zeroshard")

PRUNED_SUFFIX = ".pruned"


class Deleter:
    """Deletes renamed-away directories on a thread of its own, one batch at a time.

    `join` waits for the batch in flight (a checkpointer joins before the next prune, a load, and
    in `wait`, so a script that waits sees the directory as `keep_last` leaves it). The thread is
    not a daemon: a script that ends right after a save still finishes deleting; a process killed
    meanwhile leaves `.TAG.pruned`, which the next prune deletes."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def delete(self, paths: list[Path]) -> None:
        self.join()
        if paths:
            self._thread = threading.Thread(target=_remove_all, args=(paths,), name="zeroshard-prune")
            self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _remove_all(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def prune(root: str | os.PathLike[str], keep_last: int, deleter: Deleter | None = None) -> list[str]:
    """Remove all but the `keep_last` newest complete tags under `root`; returns the removed tags.
    Run by the rank that publishes (no collective). `keep_last` 0 keeps everything. With a
    `deleter`, the renamed tags are deleted on its thread; without one, before returning."""
    root = Path(root)
    if keep_last <= 0 or not root.is_dir():
        return []
    if deleter is not None:
        deleter.join()  # the last batch, before its leftovers are looked for
    doomed_dirs = list(root.glob(f".*{PRUNED_SUFFIX}"))
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
        except OSError as e:  # a removal that fails costs disk space, never a checkpoint
            logger.warning(f"checkpoint.keep_last: could not remove {root / tag}: {e}")
            continue
        doomed_dirs.append(doomed)
        removed.append(tag)
    if deleter is not None:
        deleter.delete(doomed_dirs)
    else:
        _remove_all(doomed_dirs)
    if removed:
        logger.info(f"checkpoint.keep_last={keep_last}: removed {', '.join(removed)} from {root}")
    return removed
