"""Auto-resume (`checkpoint.auto_resume_dir`, issue 42) with a pipeline and with AutoTP: the newest
complete, verified checkpoint is found (a damaged newest one skipped by name), loaded with the
built-in data loader's position, and training continues with the uninterrupted run's losses.

Pipeline: one stage at world 1, 2 stages at 2, 3 at 3 (test_pipeline.py's layers and loss), ZeRO 1.
AutoTP: TP 2 at world 2, TP 3 at 3 (tp_helpers' tiny Llama), ZeRO 2. Each run saves at steps 2
and 4 of 6; a copy whose step-4 checkpoint lost a file must resume at step 2, an intact copy at 4.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import capture_zeroshard_log
from test_pipeline import BASE_SEED, GAS, MICRO, SEQ, VOCAB, loss_fn, specs, stage_layouts
from tp_helpers import lm_loss, tiny_llama, tp_config

import zeroshard
from zeroshard.comm import Comm, ProcessGroups
from zeroshard.pipe import PipelineModule

STEPS, SAVES = 6, (2, 4)


def _tokens(n: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(7))


def _pipe_engine(groups: ProcessGroups, checkpoint: dict[str, Any]) -> Any:
    stages = stage_layouts(groups.world_size)[0]
    net = PipelineModule(specs(2 * stages, True), num_stages=stages, loss_fn=loss_fn, seed_layers=True,
                         base_seed=BASE_SEED)
    tokens = _tokens(96, SEQ, VOCAB)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 0.5, "steps_per_print": 1000,
        "zero_optimization": {"stage": 1}, **({"checkpoint": checkpoint} if checkpoint else {})}
    engine, *_ = zeroshard.initialize(model=net, model_parameters=list(net.parameters()), training_data=data,
                                      config=cfg)
    return engine


def _pipe_step(engine: Any) -> float:
    return float(engine.train_batch())  # micro-batches from the built-in loader


def _tp_size(world: int) -> int:
    return {2: 2, 3: 3}.get(world, 0)


def _tp_engine(groups: ProcessGroups, checkpoint: dict[str, Any]) -> Any:
    tp = _tp_size(groups.world_size)
    model = tiny_llama(heads=6, kv_heads=3, hidden=48) if tp == 3 else tiny_llama()
    data = torch.utils.data.TensorDataset(_tokens(64, 8, 64)[:, :8])
    extra = {"checkpoint": checkpoint} if checkpoint else {}
    engine, *_ = zeroshard.initialize(model=model, training_data=data, config=tp_config(tp, 2, 1, **extra))
    engine._test_batches = iter(engine.training_dataloader)
    return engine


def _tp_step(engine: Any) -> float:
    (ids,) = next(engine._test_batches)
    loss = lm_loss(engine, ids)
    engine.backward(loss)
    engine.step()
    return loss.item()


LAYOUTS: dict[str, tuple[Callable[[ProcessGroups, dict[str, Any]], Any], Callable[[Any], float]]] = {
    "pipeline": (_pipe_engine, _pipe_step), "autotp": (_tp_engine, _tp_step)}


def _shared_tmp(comm: Comm, base: Path, name: str) -> Path:
    path = base / name
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    comm.barrier()
    return path


@pytest.mark.parametrize("damaged", [True, False], ids=["newest-damaged", "intact"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_resumes_with_the_uninterrupted_losses(groups: ProcessGroups, comm: Comm, shared_dir: Path, layout: str,
                                               damaged: bool) -> None:
    if layout == "autotp" and not _tp_size(groups.world_size):
        pytest.skip(f"AutoTP here needs 2 or 3 ranks (this run has {groups.world_size})")
    build, step = LAYOUTS[layout]
    saves = _shared_tmp(comm, shared_dir, "saves")
    first = build(groups, {})
    whole = []
    for _ in range(STEPS):
        whole.append(step(first))
        if first.global_steps in SAVES:
            first.save_checkpoint(saves)
    resume_dir = _shared_tmp(comm, shared_dir, "resume")
    if comm.rank == 0:
        shutil.copytree(saves, resume_dir)
        if damaged:  # the newest checkpoint lost a file after it was written
            victim = sorted(p for p in (resume_dir / "global_step4").rglob("*.pt"))[-1]
            victim.unlink()
    comm.barrier()
    with capture_zeroshard_log() as log:
        second = build(groups, {"auto_resume_dir": str(resume_dir)})
    start = 2 if damaged else 4
    assert second.global_steps == start
    if damaged and groups.rank == 0:
        assert "skipping checkpoint" in log.getvalue() and "global_step4" in log.getvalue(), log.getvalue()
    for i in range(start, STEPS):
        got = step(second)
        assert math.isclose(got, whole[i], rel_tol=1e-6), f"{layout} step {i + 1}: resumed {got} != {whole[i]}"
