"""Optimizer offload to NVMe reproduces CPU offload bitwise (stages 1, 2, 3; fp32 and bf16).

The same 20 steps as tests/dist/test_zero12.py (2 micro-batches, active clipping), with
`sub_group_size` small enough that the swap pipeline walks many sub-groups and cuts fragments.
Run at world sizes 1 (plain pytest) and 2 (torchrun).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import assert_params_close, make_config
from test_zero12 import STEPS, run

ROOT = Path(tempfile.gettempdir()) / "zeroshard-test-nvme"


def config(stage: int, precision: str, device: str) -> dict[str, Any]:
    extra: dict[str, Any] = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    offload: dict[str, Any] = {"device": device}
    if device == "nvme":
        ROOT.mkdir(exist_ok=True)
        offload["nvme_path"] = str(ROOT)
    zero = {"stage": stage, "reduce_bucket_size": 300, "sub_group_size": 640, "offload_optimizer": offload}
    return make_config(gradient_accumulation_steps=2, gradient_clipping=0.05, zero_optimization=zero,
                       aio={"block_size": 4096, "queue_depth": 2, "intra_op_parallelism": 2}, **extra)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_matches_cpu_offload_bitwise(groups, stage: int, precision: str) -> None:
    _, want = run(config(stage, precision, "cpu"), groups.rank, groups.world_size)
    engine, got = run(config(stage, precision, "nvme"), groups.rank, groups.world_size)
    for step in range(STEPS):
        assert_params_close(got[step], want[step], 0.0, f"stage {stage} step {step}")
        for g, w in zip(got[step], want[step]):
            assert torch.equal(g, w), f"stage {stage} step {step}: not bitwise equal"
    swap = engine.optimizer.swap
    assert swap.dir.is_dir() and swap.dir.parent.parent == ROOT / "zeroshard-swap"
    assert len(swap._groups()) > 1, "the test must walk several sub-groups"
    engine.optimizer.close()
    assert not swap.dir.exists()


def test_swap_dir_checked_at_initialize(groups, tmp_path: Path) -> None:
    from engine_helpers import init_engine, make_model

    from zeroshard.errors import ConfigError

    def cfg(path: Path, **opt: Any) -> dict[str, Any]:
        return make_config(
            zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(path)}}, **opt)

    with pytest.raises(ConfigError, match=r"offload_optimizer\.nvme_path: .*missing.* does not exist"):
        init_engine(make_model(), cfg(tmp_path / "missing"))
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        init_engine(make_model(), cfg(tmp_path / "f"))
    with pytest.raises(ConfigError, match=r'"nvme" steps Adam/AdamW; the optimizer is SGD'):
        init_engine(make_model(), cfg(tmp_path, optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    assert not list((tmp_path / "zeroshard-swap").glob("*/rank*")), "a refused optimizer leaves no swap files"


@pytest.mark.parametrize("stage,precision", [(2, "bf16"), (3, "fp32")])
def test_checkpoint_resume_and_cpu_offload_load_it(groups, shared_dir: Path, stage: int, precision: str) -> None:
    """save_checkpoint writes the normal format from the swap files; a resumed NVMe run rebuilds
    its swap files from it and continues bitwise, and a CPU-offload run loads it the same way."""
    from engine_helpers import init_engine, make_model, train_engine
    from test_checkpoint import STEPS_BEFORE, assert_equal, batches
    from test_checkpoint import config as ckpt_config

    def cfg(device: str) -> dict[str, Any]:
        c = ckpt_config(stage, precision)
        c["zero_optimization"]["offload_optimizer"] = config(stage, precision, device)["zero_optimization"][
            "offload_optimizer"]
        c["zero_optimization"]["sub_group_size"] = 640
        return c

    rank, world = groups.rank, groups.world_size
    data = batches(world)
    ckpt = shared_dir
    engine = init_engine(make_model(), cfg("nvme"))
    train_engine(engine, data[:STEPS_BEFORE], rank, world)
    engine.save_checkpoint(ckpt)
    want_losses, want = train_engine(engine, data[STEPS_BEFORE:], rank, world)
    for device in ("nvme", "cpu"):
        resumed = init_engine(make_model(seed=7), cfg(device))
        resumed.load_checkpoint(ckpt)
        got_losses, got = train_engine(resumed, data[STEPS_BEFORE:], rank, world)
        assert got_losses == want_losses, device
        for step, (g, w) in enumerate(zip(got, want)):
            assert_equal(g, w, f"{device}: step {STEPS_BEFORE + step}")
        if device == "nvme":
            resumed.optimizer.close()
    engine.optimizer.close()
