"""Asynchronous and periodic saves (issue 42 item 3) inside one process group (world 1, 2, 3).

- The snapshot is the state at the save: an asynchronous save, followed by training steps while
  its files are written, holds what a synchronous save at the same moment holds (every file
  decoded and compared bitwise), and a fresh engine loading it resumes with the same losses.
- `latest` switches only at the join: not when save_checkpoint returns; a second save joins the
  first.
- Periodic saves every N steps (sync and async) and every T minutes keep the last K tags.
- A background writer's error is raised on every rank at the join, naming the rank; `latest`
  still names the previous tag, and the next save works.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import global_batches, init_engine, make_config, make_model, train_engine

from zeroshard.checkpoint import ShardedCheckpointer
from zeroshard.checkpoint import save as save_module
from zeroshard.checkpoint.files import MANIFEST, staging_dir
from zeroshard.checkpoint.manifest import read_latest
from zeroshard.checkpoint.verify import verify
from zeroshard.comm import Comm
from zeroshard.config import load_config
from zeroshard.errors import CheckpointError, ConfigError


def config(stage: int = 2, **checkpoint: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 300}
    if stage == 3:  # the tiny model's tensors are small: partition those above 100 elements
        zero["stage3_param_persistence_threshold"] = 100
    return make_config(zero_optimization=zero, **({"checkpoint": checkpoint} if checkpoint else {}))


def tags(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def same(a: Any, b: Any, where: str) -> None:
    """Decoded checkpoint contents, equal bitwise (tensors: dtype, shape and every bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        bits = lambda t: t.detach().reshape(-1).contiguous().view(torch.uint8)  # noqa: E731 -- NaN-safe, -0.0 too
        assert torch.equal(bits(a), bits(b)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("stage", [1, 3])
def test_async_save_holds_the_state_at_the_save(comm: Comm, shared_dir: Path, stage: int) -> None:
    world, rank = comm.world_size, comm.rank
    batches = global_batches(4, 2 * world)
    engine = init_engine(make_model(), config(stage, async_save=True))
    train_engine(engine, batches[:2], rank, world)
    # The same state through the synchronous path (the same format, written before returning).
    ShardedCheckpointer(comm).save(engine.state(include_frozen=True), shared_dir / "sync", "t", {"epoch": 1}, True)
    path = engine.save_checkpoint(shared_dir / "async", tag="t", client_state={"epoch": 1})
    assert path == str(shared_dir / "async" / "t")
    assert read_latest(shared_dir / "async") is None  # nothing is published before the join
    later, _ = train_engine(engine, batches[2:], rank, world)  # the live tensors change while it writes
    assert engine.wait_for_checkpoint() == path
    assert engine.wait_for_checkpoint() is None  # nothing in flight any more
    comm.barrier()
    assert read_latest(shared_dir / "async") == "t" and verify(shared_dir / "async" / "t") == []
    sync_m = json.loads((shared_dir / "sync" / "t" / MANIFEST).read_text())
    async_m = json.loads((shared_dir / "async" / "t" / MANIFEST).read_text())
    # File sizes may differ: torch.save writes a view's whole storage, the snapshot owns compact copies.
    same({k: v for k, v in async_m.items() if k not in ("checksums", "files")},
         {k: v for k, v in sync_m.items() if k not in ("checksums", "files")}, "manifest")
    assert async_m["files"].keys() == sync_m["files"].keys()
    for name in sorted(sync_m["files"]):
        got = torch.load(shared_dir / "async" / "t" / name, weights_only=True)
        want = torch.load(shared_dir / "sync" / "t" / name, weights_only=True)
        same(got, want, name)
    fresh = init_engine(make_model(seed=5), config(stage))
    loaded, client = fresh.load_checkpoint(shared_dir / "async", load_rng_state=True)
    assert Path(str(loaded)).name == "t" and client == {"epoch": 1} and fresh.global_steps == 2
    resumed, _ = train_engine(fresh, batches[2:], rank, world)
    assert resumed == later  # the state at step 2, not a later one


def test_second_save_joins_the_first(comm: Comm, shared_dir: Path) -> None:
    world, rank = comm.world_size, comm.rank
    batches = global_batches(2, 2 * world)
    engine = init_engine(make_model(), config(async_save=True))
    train_engine(engine, batches[:1], rank, world)
    engine.save_checkpoint(shared_dir, tag="a")
    train_engine(engine, batches[1:], rank, world)
    engine.save_checkpoint(shared_dir, tag="b")  # joins "a" first: "a" is published, "b" is in flight
    comm.barrier()
    assert read_latest(shared_dir) == "a" and verify(shared_dir / "a") == []
    assert not (shared_dir / "b").exists() and staging_dir(shared_dir, "b").is_dir()
    comm.barrier()
    engine.destroy()  # joins too
    comm.barrier()
    assert read_latest(shared_dir) == "b" and verify(shared_dir / "b") == [] and tags(shared_dir) == ["a", "b"]


@pytest.mark.parametrize("async_save", [False, True])
def test_periodic_save_keeps_the_last_k(comm: Comm, shared_dir: Path, async_save: bool) -> None:
    world, rank = comm.world_size, comm.rank
    engine = init_engine(make_model(), config(async_save=async_save, save_dir=str(shared_dir),
                                              save_interval_steps=2, keep_last=2))
    train_engine(engine, global_batches(7, 2 * world), rank, world)
    engine.wait_for_checkpoint()
    comm.barrier()
    assert tags(shared_dir) == ["global_step4", "global_step6"], tags(shared_dir)
    assert read_latest(shared_dir) == "global_step6"
    assert all(verify(shared_dir / t) == [] for t in tags(shared_dir))
    assert not [p.name for p in shared_dir.iterdir() if p.name.startswith(".")]  # no staging, no pruned leftovers


def test_periodic_save_needs_a_directory() -> None:
    with pytest.raises(ConfigError, match="checkpoint.save_interval_steps: got 5, but checkpoint.save_dir is not set"):
        load_config(config(save_interval_steps=5), dp_world_size=1)


def test_periodic_save_by_the_clock(comm: Comm, shared_dir: Path) -> None:
    world, rank = comm.world_size, comm.rank
    # A tiny interval: every step is due (by rank 0's clock, on every rank alike).
    engine = init_engine(make_model(), config(async_save=True, save_dir=str(shared_dir),
                                              save_interval_minutes=1e-9, keep_last=1))
    train_engine(engine, global_batches(3, 2 * world), rank, world)
    engine.wait_for_checkpoint()
    comm.barrier()
    assert tags(shared_dir) == ["global_step3"] and read_latest(shared_dir) == "global_step3"


def test_writer_error_is_raised_on_every_rank(comm: Comm, shared_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    world, rank = comm.world_size, comm.rank
    failing = world - 1
    batches = global_batches(4, 2 * world)
    engine = init_engine(make_model(), config(async_save=True))
    train_engine(engine, batches[:1], rank, world)
    engine.save_checkpoint(shared_dir, tag="good")
    engine.wait_for_checkpoint()

    def disk_full(path: Path, obj: Any) -> tuple[int, str]:
        raise OSError(28, "No space left on device", str(path))

    if rank == failing:
        monkeypatch.setattr(save_module, "save_torch_checked", disk_full)
    train_engine(engine, batches[1:2], rank, world)
    engine.save_checkpoint(shared_dir, tag="bad")  # returns; the writer fails in the background
    train_engine(engine, batches[2:3], rank, world)  # training goes on
    with pytest.raises(CheckpointError, match="(?s)checkpoint bad in the background failed.*No space left") as e:
        engine.wait_for_checkpoint()
    assert f"rank {failing}" in str(e.value)
    monkeypatch.undo()
    comm.barrier()
    assert read_latest(shared_dir) == "good" and verify(shared_dir / "good") == []
    assert not (shared_dir / "bad").exists() and not staging_dir(shared_dir, "bad").exists()
    comm.barrier()
    train_engine(engine, batches[3:], rank, world)
    engine.save_checkpoint(shared_dir, tag="after")  # the failure is spent: the next save works
    assert engine.wait_for_checkpoint() == str(shared_dir / "after")
    comm.barrier()
    assert read_latest(shared_dir) == "after" and verify(shared_dir / "after") == []
