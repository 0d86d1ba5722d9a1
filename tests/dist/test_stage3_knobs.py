"""Three DeepSpeed zero_optimization keys zeroshard used to refuse, at 1/2/3 ranks:
`stage3_module_granularity_threshold` (fine-grained modules gathered as one unit),
`stage3_model_persistence_threshold` (a cap on what stays gathered) and
`pipeline_loading_checkpoint` (a node's ranks read a checkpoint one at a time)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.checkpoint import load as ckpt_load
from zeroshard.zero import GatheredParameters


class MLPBlock(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.up = nn.Linear(h, h)
        self.down = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class FineGrained(nn.Module):
    def __init__(self, h: int, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(h) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Model(nn.Module):
    """DeepSpeed's test shape: two wide layers, then many small blocks in a ModuleList."""

    def __init__(self, h: int = 16, n: int = 6) -> None:
        super().__init__()
        self.wide1 = nn.Linear(h, 8 * h)
        self.wide2 = nn.Linear(8 * h, h)
        self.fine = FineGrained(h, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fine(self.wide2(self.wide1(x))).pow(2).mean()


H, N = 16, 6
BLOCK = 2 * (H * H + H)  # one MLPBlock's elements: 544
# DeepSpeed's measure counts every module with parameters in the subtree, torch leaves included:
# a block is 544 // 3 = 181, FineGrained (6 x 3 + 1 modules) 3264 // 19 = 171, the root 7504 // 22 = 341.
BLOCK_GRANULARITY = BLOCK // 3
FINE_GRANULARITY = (N * BLOCK) // (3 * N + 1)
ROOT_GRANULARITY = (N * BLOCK + (H * 8 * H + 8 * H) + (8 * H * H + H)) // (3 * N + 4)


def build(zero: dict[str, Any], precision: str = "fp32") -> Any:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                           "zero_optimization": {"stage": 3, **zero},
                           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    torch.manual_seed(0)
    model = Model(H, N)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def losses(engine: Any, rank: int, steps: int = 3) -> list[float]:
    out = []
    for step in range(steps):
        x = torch.randn(2, H, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def units_of(engine: Any) -> dict[str, int]:
    strategy = engine._strategy
    return {n: strategy.unit_of(p) for n, p in engine.module.named_parameters()}


def test_granularity_measure_is_deepspeeds() -> None:
    from zeroshard.zero.leaf import module_granularity

    model = Model(H, N)
    gran = module_granularity(model)
    assert gran[id(model.fine)] == FINE_GRANULARITY
    assert gran[id(model)] == ROOT_GRANULARITY
    assert gran[id(model.fine.blocks[0])] == BLOCK_GRANULARITY
    for never in (model.fine.blocks, model.wide1, model.fine.blocks[0].up):  # container, torch leaves
        assert gran[id(never)] > 10**15


@pytest.mark.parametrize("threshold, expect", [
    (0, "blocks"),                      # off: each ModuleList block is its own unit
    (FINE_GRANULARITY - 1, "blocks"),   # below every granularity: nothing changes (and a warning)
    (BLOCK_GRANULARITY, "fine"),        # FineGrained qualifies before its blocks (preorder): one unit
    (ROOT_GRANULARITY - 1, "fine"),
    (ROOT_GRANULARITY, "root"),         # the root qualifies: one unit for everything
])
def test_granularity_threshold_coarsens_units_and_trains_the_same(groups: Any, threshold: int, expect: str) -> None:
    base = build({"stage3_param_persistence_threshold": 0})
    want = losses(base, groups.rank)
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zeroshard").addHandler(handler)
    try:
        engine = build({"stage3_param_persistence_threshold": 0, "stage3_module_granularity_threshold": threshold})
    finally:
        logging.getLogger("zeroshard").removeHandler(handler)
    units = units_of(engine)
    block_units = {units[f"fine.blocks.{i}.up.weight"] for i in range(N)}
    if expect == "blocks":
        assert len(block_units) == N, units
        assert units["wide1.weight"] == units["wide2.weight"] != units["fine.blocks.0.up.weight"]
    elif expect == "fine":
        assert len(block_units) == 1, units
        assert units["fine.blocks.0.up.weight"] != units["wide1.weight"]
    else:
        assert len(set(units.values())) == 1, units
    nothing = any("selects no module" in w for w in warnings)
    assert nothing == (0 < threshold < FINE_GRANULARITY), warnings
    got = losses(engine, groups.rank)
    # The same reductions in other buckets: equal to the last bits at 1-2 ranks, within fp32
    # rounding of a 3-way sum otherwise.
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=0)


@pytest.mark.parametrize("budget", [0, BLOCK - 1, H + H * H + H, 10**12])
def test_model_persistence_threshold_caps_what_stays_gathered(groups: Any, budget: int) -> None:
    """Every parameter is below stage3_param_persistence_threshold; the budget takes them in the
    model's order while the total fits (a larger one is skipped, later small ones still fit)."""
    engine = build({"stage3_param_persistence_threshold": 10**6, "stage3_model_persistence_threshold": budget})
    total, want = 0, set()
    for name, p in engine.module.named_parameters():
        if total + p.numel() <= budget:
            want.add(name)
            total += p.numel()
    got = {n for n, p in engine.module.named_parameters() if engine._strategy.is_persistent(p)}
    assert got == want
    if budget == H + H * H + H:  # wide1.weight (2048) is skipped, its bias and later ones are taken
        assert "wide1.weight" not in got and "wide1.bias" in got
    assert all(torch.isfinite(torch.tensor(losses(engine, groups.rank, steps=2))))


def test_pipeline_loading_checkpoint_reads_one_local_rank_at_a_time(groups: Any, shared_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    engine = build({"pipeline_loading_checkpoint": True})
    losses(engine, groups.rank, steps=1)
    engine.save_checkpoint(shared_dir, tag="t")

    spans: list[tuple[float, float]] = []
    real = ckpt_load.load_torch

    def slow_load(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        time.sleep(0.1)  # long enough that ranks reading at once would overlap
        out = real(*args, **kwargs)
        spans.append((start, time.time()))
        return out

    monkeypatch.setattr(ckpt_load, "load_torch", slow_load)
    other = build({"pipeline_loading_checkpoint": True})
    path, _ = other.load_checkpoint(shared_dir, tag="t")
    assert path is not None and spans
    (shared_dir / f"spans{groups.rank}.json").write_text(json.dumps([spans[0][0], spans[-1][1]]))
    other._comm.barrier()
    windows = [json.loads((shared_dir / f"spans{r}.json").read_text()) for r in range(groups.world_size)]
    for r in range(1, groups.world_size):  # local rank r reads after local rank r-1 finished
        assert windows[r][0] >= windows[r - 1][1], windows
    with GatheredParameters(list(other.module.parameters())), GatheredParameters(list(engine.module.parameters())):
        for n, p in other.module.named_parameters():
            assert torch.equal(p, dict(engine.module.named_parameters())[n]), n
