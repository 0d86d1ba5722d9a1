"""`checkpoint.use_node_local_storage` (Hugging Face Trainer's `save_on_each_node`) at 1/2/3 ranks.

Nodes are simulated with ``ZEROSHARD_NODE_SIZE=1`` (every rank its own node) and a save directory
per node, standing in for each node's local disk: each must come out a complete checkpoint for
its node's ranks, resume from it must be bitwise the run that never stopped, and a load that
needs another node's files must say so. See Note: [node-local storage] in checkpoint/save.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import init_engine, make_model, train_engine
from test_checkpoint import STEPS_AFTER, STEPS_BEFORE, assert_equal, batches, config

from zeroshard.checkpoint.files import LATEST, MANIFEST, MODEL_FILE, WRITER_TOKEN, optim_file, rng_file
from zeroshard.checkpoint.manifest import read_manifest
from zeroshard.comm.groups import NODE_SIZE_ENV
from zeroshard.errors import CheckpointError

NODE_LOCAL = {"checkpoint": {"use_node_local_storage": True}}


def node_dir(root: Path, rank: int) -> Path:
    """Node n's "local disk" (node size 1: node n is rank n)."""
    return root / f"node{rank}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_node_directory_resumes_bitwise(groups: Any, shared_dir: Path, monkeypatch: Any, stage: int) -> None:
    monkeypatch.setenv(NODE_SIZE_ENV, "1")
    rank, world = groups.rank, groups.world_size
    data = batches(world)
    engine = init_engine(make_model(), config(stage, **NODE_LOCAL))
    train_engine(engine, data[:STEPS_BEFORE], rank, world)
    mine = node_dir(shared_dir, rank)
    path = engine.save_checkpoint(mine, client_state={"step": 3})
    assert Path(path) == mine / f"global_step{STEPS_BEFORE}"
    want_losses, want = train_engine(engine, data[STEPS_BEFORE:], rank, world)

    # This node's directory: latest, manifest, model file, this rank's files and no other rank's.
    ckpt = Path(path)
    assert (mine / LATEST).read_text().strip() == ckpt.name
    manifest = read_manifest(ckpt)
    assert manifest.world_size == world
    assert manifest.node_ranks == (None if world == 1 else [rank])
    on_disk = set(os.listdir(ckpt))
    assert {MANIFEST, MODEL_FILE, optim_file(rank), rng_file(rank)} <= on_disk, on_disk
    assert not any(optim_file(r) in on_disk or rng_file(r) in on_disk for r in range(world) if r != rank), on_disk
    assert WRITER_TOKEN not in on_disk
    assert set(manifest.files) >= {optim_file(r) for r in range(world)}  # the whole job's layout

    resumed = init_engine(make_model(seed=7), config(stage, **NODE_LOCAL))
    got_path, client = resumed.load_checkpoint(mine, load_rng_state=True)
    assert got_path == path and client == {"step": 3}
    got_losses, got = train_engine(resumed, data[STEPS_BEFORE:], rank, world)
    assert got_losses == want_losses
    for step in range(STEPS_AFTER):
        assert_equal(got[step], want[step], f"stage {stage}, node-local resume, step {STEPS_BEFORE + step}")


def test_one_shared_directory_gets_one_writer(groups: Any, shared_dir: Path, monkeypatch: Any) -> None:
    """The flag on, but every "node" saves to the same directory (a shared file system): rank 0's
    token tells the other nodes' first ranks so, and the checkpoint is the ordinary one."""
    monkeypatch.setenv(NODE_SIZE_ENV, "1")
    rank, world = groups.rank, groups.world_size
    data = batches(world)
    engine = init_engine(make_model(), config(2, **NODE_LOCAL))
    train_engine(engine, data[:STEPS_BEFORE], rank, world)
    path = Path(engine.save_checkpoint(shared_dir))
    manifest = read_manifest(path)
    assert manifest.node_ranks is None
    on_disk = set(os.listdir(path))
    assert {optim_file(r) for r in range(world)} <= on_disk and WRITER_TOKEN not in on_disk, on_disk
    _, want = train_engine(engine, data[STEPS_BEFORE:], rank, world)
    resumed = init_engine(make_model(seed=7), config(2))  # a run without the flag reads it too
    resumed.load_checkpoint(shared_dir, load_rng_state=True)
    _, got = train_engine(resumed, data[STEPS_BEFORE:], rank, world)
    for step in range(STEPS_AFTER):
        assert_equal(got[step], want[step], f"shared directory, step {STEPS_BEFORE + step}")


def test_one_node_is_the_ordinary_checkpoint(groups: Any, shared_dir: Path, monkeypatch: Any) -> None:
    """All ranks on one node (the launcher's local ranks): rank 0 alone writes, as without the flag."""
    monkeypatch.delenv(NODE_SIZE_ENV, raising=False)
    rank, world = groups.rank, groups.world_size
    engine = init_engine(make_model(), config(1, **NODE_LOCAL))
    train_engine(engine, batches(world, 1), rank, world)
    path = Path(engine.save_checkpoint(shared_dir))
    assert read_manifest(path).node_ranks is None
    assert {optim_file(r) for r in range(world)} <= set(os.listdir(path))


def test_a_load_needing_other_nodes_files_names_the_fix(groups: Any, shared_dir: Path, monkeypatch: Any) -> None:
    """Saved per node at stage 3 (each node holds its own weight pieces), loaded at stage 0 (every
    rank needs every piece): at world > 1 the error says to gather the nodes' directories; at
    world 1 the one directory has everything and the load works."""
    monkeypatch.setenv(NODE_SIZE_ENV, "1")
    rank, world = groups.rank, groups.world_size
    engine = init_engine(make_model(), config(3, **NODE_LOCAL))
    train_engine(engine, batches(world, 1), rank, world)
    mine = node_dir(shared_dir, rank)
    engine.save_checkpoint(mine)
    other = init_engine(make_model(seed=3), config(0))
    if world == 1:
        assert other.load_checkpoint(mine)[0] is not None
        return
    with pytest.raises(CheckpointError,
                       match=r"use_node_local_storage.*Copy the global_step1/ directory of every node"):
        other.load_checkpoint(mine)
