"""`checkpoint.keep_last` (checkpoint/retention.py): which tags a prune removes, and that the
deleting runs off the caller's thread while the tags are gone from the root at once."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from zeroshard.checkpoint import retention
from zeroshard.checkpoint.files import LATEST
from zeroshard.checkpoint.retention import PRUNED_SUFFIX, Deleter, prune
from zeroshard.checkpoint.verify import PIPELINE_FILE


def _tags(root: Path, steps: list[int], latest: int) -> None:
    for step in steps:  # a pipeline layout file makes a complete tag without a ZeRO manifest
        d = root / f"global_step{step}"
        d.mkdir(parents=True)
        (d / PIPELINE_FILE).write_text("{}")
        (d / "mp_rank_00_model_states.pt").write_bytes(b"x" * 1024)
    (root / LATEST).write_text(f"global_step{latest}")


def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_prune_keeps_the_newest_and_latest(tmp_path: Path) -> None:
    _tags(tmp_path, [1, 2, 3, 4], latest=1)  # `latest` names an old tag (a user's choice): it stays
    assert prune(tmp_path, 2) == ["global_step2"]
    assert _listing(tmp_path) == ["global_step1", "global_step3", "global_step4", LATEST]
    assert prune(tmp_path, 0) == []  # 0 keeps everything


def test_deleting_runs_on_the_deleters_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _tags(tmp_path, [1, 2, 3], latest=3)
    release, deleted_by = threading.Event(), []
    real_rmtree = shutil.rmtree

    def slow_rmtree(path: Path, ignore_errors: bool = False) -> None:
        deleted_by.append(threading.current_thread().name)
        assert release.wait(30), "the test never released the deleter"
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(retention.shutil, "rmtree", slow_rmtree)
    deleter = Deleter()
    try:
        assert prune(tmp_path, 1, deleter) == ["global_step2", "global_step1"]  # returns while deleting
        # the tags left the root before prune returned; only their renamed directories remain
        assert _listing(tmp_path) == [f".global_step1{PRUNED_SUFFIX}", f".global_step2{PRUNED_SUFFIX}",
                                      "global_step3", LATEST]
    finally:
        release.set()
        deleter.join()
    assert _listing(tmp_path) == ["global_step3", LATEST]
    assert deleted_by and set(deleted_by) == {"zeroshard-prune"}


def test_leftovers_of_a_killed_deletion_go_at_the_next_prune(tmp_path: Path) -> None:
    _tags(tmp_path, [5, 6], latest=6)
    leftover = tmp_path / f".global_step3{PRUNED_SUFFIX}"  # a process killed while deleting
    leftover.mkdir()
    (leftover / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    deleter = Deleter()
    assert prune(tmp_path, 1, deleter) == ["global_step5"]
    deleter.join()
    assert _listing(tmp_path) == ["global_step6", LATEST]
