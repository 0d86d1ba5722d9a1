"""MoE routing telemetry through the engine (moe/telemetry.py, runtime/engine_progress.py): the
tokens per expert and dropped routes the CSV monitor writes per layer and step equal the sum over
ranks of what each rank's gate routed (ZeRO 1 and 3), the window of steps_per_print steps is reduced once, at the
logged step, and an engine without MoE layers counts nothing. Runs at 1 and 2 ranks (EP = world
size; tests/run.py keeps it out of the 3-rank stage: 4 experts do not split over 3 ranks)."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import zeroshard
from zeroshard.comm import Comm, ProcessGroups
from zeroshard.moe.layer import MoE
from zeroshard.moe.utils import split_params_into_different_moe_groups_for_optimizer

HIDDEN, TOKENS, MICRO, GAS, EXPERTS = 8, 6, 2, 2, 4


class Net(nn.Module):
    """Two MoE layers: top-1 at half capacity (drops routes), top-2 without dropping."""

    def __init__(self, ep_size: int) -> None:
        super().__init__()
        expert = nn.Sequential(nn.Linear(HIDDEN, 12), nn.GELU(), nn.Linear(12, HIDDEN))
        self.drops = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep_size, k=1, capacity_factor=0.5,
                         min_capacity=0, use_rts=False)
        self.dropless = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=ep_size, k=2, drop_tokens=False)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h, aux1, _ = self.drops(x)
        h, aux2, _ = self.dropless(torch.tanh(h))
        return F.mse_loss(h, y) + 0.01 * (aux1 + aux2)


def make_engine(world: int, out: Path, steps_per_print: int, stage: int = 1) -> tuple[Any, Net]:
    torch.manual_seed(0)
    model = Net(ep_size=world)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "all"})
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "steps_per_print": steps_per_print,
           "zero_optimization": {"stage": stage},
           "csv_monitor": {"enabled": True, "output_path": str(out), "job_name": "moe"}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=groups, config=cfg)
    return engine, model


def gate_counts(model: Net) -> list[list[Tensor]]:
    """Each layer's gate Routes as [routes per expert, dropped routes], appended per forward."""
    seen: list[list[Tensor]] = [[], []]
    for i, layer in enumerate((model.drops, model.dropless)):
        layer.deepspeed_moe.gate.register_forward_hook(
            lambda _m, _i, r, i=i: seen[i].append(torch.cat([r.exp_counts, (r.experts < 0).sum().reshape(1)])))
    return seen


def train(engine: Any, rank: int, steps: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)  # every rank routes its own tokens
    for _ in range(steps * GAS):
        x, y = torch.randn(MICRO, TOKENS, HIDDEN, generator=g), torch.randn(MICRO, TOKENS, HIDDEN, generator=g)
        engine.backward(engine(x, y))
        engine.step()


def csv_rows(out: Path) -> list[dict[str, float]]:
    with (out / "moe" / "metrics.csv").open() as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


@pytest.mark.parametrize("stage", [1, 3])
def test_csv_series_equal_the_gates_counts_summed_over_ranks(groups: ProcessGroups, comm: Comm, shared_dir: Path,
                                                              stage: int) -> None:
    world, rank, steps = groups.world_size, groups.rank, 3
    engine, model = make_engine(world, shared_dir, steps_per_print=1, stage=stage)
    seen = gate_counts(model)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("zeroshard").addHandler(handler)
    try:
        train(engine, rank, steps)
    finally:
        logging.getLogger("zeroshard").removeHandler(handler)
    # [step, layer, experts + 1]: this rank's gate counts per optimizer step, then summed over ranks
    mine = torch.stack([torch.stack([sum(seen[i][s * GAS:(s + 1) * GAS]) for i in range(2)]) for s in range(steps)])
    total = mine.double().clone()
    comm.all_reduce(total, op="sum")
    assert all(len(s) == steps * GAS for s in seen)
    assert mine[:, 0, -1].sum() > 0 and mine[:, 1, -1].sum() == 0  # half capacity drops; dropless never
    if rank != 0:
        return  # rank 0 writes the CSV and logs
    rows = csv_rows(shared_dir)
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1))
    for s, row in enumerate(rows):
        for layer in range(2):
            tokens = [row[f"moe{layer}_tokens_expert{e}"] for e in range(EXPERTS)]
            assert tokens == total[s, layer, :EXPERTS].tolist()
            assert sum(tokens) == (layer + 1) * world * GAS * MICRO * TOKENS  # k routes per token
            assert row[f"moe{layer}_dropped"] == total[s, layer, EXPERTS].item()
            assert row[f"moe{layer}_imbalance"] == pytest.approx(max(tokens) / (sum(tokens) / EXPERTS))
            assert row[f"moe{layer}_aux_loss"] > 0
    moe_lines = [line for line in lines if line.startswith("moe")]
    assert len(moe_lines) == 2 * steps and moe_lines[0].startswith("moe0 drops | tokens/expert ")
    assert moe_lines[1].startswith("moe1 dropless |") and "| dropped 0 of " in moe_lines[1]


def test_a_window_is_reduced_once_at_the_logged_step(groups: ProcessGroups, comm: Comm, shared_dir: Path) -> None:
    world, rank = groups.world_size, groups.rank
    engine, model = make_engine(world, shared_dir, steps_per_print=2)
    seen = gate_counts(model)
    counter = model.drops.deepspeed_moe.gate.route_counter
    train(engine, rank, 1)
    assert counter._sums is not None  # step 1 is not logged: the sums stay on the device, unreduced
    train(engine, rank, 1)
    assert counter._sums is None  # step 2 is: taken and reduced
    total = sum(seen[0]).double()
    comm.all_reduce(total, op="sum")
    if rank == 0:
        [row] = csv_rows(shared_dir)
        assert row["step"] == 2
        assert [row[f"moe0_tokens_expert{e}"] for e in range(EXPERTS)] == (total[:EXPERTS] / 2).tolist()
        assert row["moe0_dropped"] == total[EXPERTS].item() / 2  # per step of the 2-step window


def test_an_engine_without_moe_counts_nothing(shared_dir: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(HIDDEN, HIDDEN)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "steps_per_print": 1, "csv_monitor": {"enabled": True, "output_path": str(shared_dir), "job_name": "moe"}}
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    assert engine._progress.routing is None
    engine.backward(engine(torch.randn(MICRO, HIDDEN)).pow(2).mean())
    engine.step()
    if engine.rank == 0:
        assert not [k for k in csv_rows(shared_dir)[0] if k.startswith("moe")]
