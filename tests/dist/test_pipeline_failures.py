"""Pipeline failures that name themselves (Note: [pipeline failure vote]): a stage whose output
changes shape, a stage that raises, a batch that cannot be drawn, every rank raising the same
PipelineError naming the stages; dynamic_shape=True trains batches of changing shapes.

World 2: 2 stages. World 4 (tests/run.py's dist4): 2 stages x data parallel 2. A rank whose
process exits is tests/launch/test_pipeline_dead_stage.py (it ends its job).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from test_pipeline import BASE_SEED, GAS, MICRO, VOCAB, loss_fn, pipe_config, reference_forward, reference_model, specs
from torch import Tensor, nn

import zeroshard
from zeroshard.comm import ProcessGroups
from zeroshard.pipe import LayerSpec, PipelineModule
from zeroshard.pipe.module import PipelineError


@pytest.fixture(autouse=True)
def two_stages(groups: ProcessGroups) -> None:
    if groups.world_size % 2:
        pytest.skip("these cases build 2 stages: world sizes 2 and 4")


class Switch(nn.Module):
    """A layer that misbehaves on the ranks and steps the test chooses."""

    mode = ""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        if Switch.mode == "raise":
            raise ValueError("boom in Switch")
        y = self.fc(x)
        return y[..., :-1] if Switch.mode == "narrow" else y.double() if Switch.mode == "double" else y


def engine_with_switch(groups: ProcessGroups, at_stage: int, **kw: Any) -> tuple[Any, int]:
    """2 stages; Switch the last layer of stage 0 or the first of stage 1. Returns (engine, dp rank)."""
    layers = specs(2, False)
    layers.insert(2 + at_stage, LayerSpec(Switch, 8))
    net = PipelineModule(layers, num_stages=2, loss_fn=loss_fn, seed_layers=True, base_seed=BASE_SEED,
                         partition_method="uniform", **kw)
    assert net.stage_owner(2 + at_stage) == at_stage and net.parts == [0, 3, 5]
    engine, *_ = zeroshard.initialize(model=net, model_parameters=list(net.parameters()),
                                      config=pipe_config(1, clip=0.0))
    return engine, groups.rank % (groups.world_size // 2)


def batch(seq: int = 6, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (GAS, MICRO, seq + 1), generator=g)
    return [(tokens[m, :, :-1], tokens[m, :, 1:]) for m in range(GAS)]


def fails_on_every_rank(engine: Any, data: list[Any], *patterns: str) -> str:
    with pytest.raises(PipelineError) as info:
        engine.train_batch(iter(data))
    text = str(info.value)
    for p in patterns:
        assert p in text, text
    return text


@pytest.mark.parametrize("mode,what", [("narrow", "[2, 6, 7] float32"), ("double", "[2, 6, 8] float64")])
def test_a_changed_activation_names_both_stages_on_every_rank(groups: ProcessGroups, mode: str, what: str) -> None:
    engine, dp_rank = engine_with_switch(groups, 0)
    engine.train_batch(iter(batch()))
    before = [p.detach().clone() for p in engine.module.parameters()]
    Switch.mode = mode if dp_rank == 0 else ""  # one data-parallel replica's stage 0 only
    try:
        fails_on_every_rank(engine, batch(),
                            f"pipeline train_batch failed on rank 0 (stage 0): stage 0's output ({what})"
                            " differs from the ([2, 6, 8] float32) stage 1 was set up to receive",
                            "dynamic_shape=True", "optimizer step was skipped")
    finally:
        Switch.mode = ""
    for a, b in zip(before, engine.module.parameters()):
        assert torch.equal(a, b), "a failed batch changed the weights"
    assert math.isfinite(float(engine.train_batch(iter(batch(seed=1)))))  # the group and schedule still work


@pytest.mark.parametrize("at_stage", [0, 1])
def test_a_stage_that_raises_is_named_on_every_rank(groups: ProcessGroups, at_stage: int) -> None:
    engine, dp_rank = engine_with_switch(groups, at_stage)
    engine.train_batch(iter(batch()))
    last_rank = groups.world_size - 1  # stage 1, the last data-parallel replica
    Switch.mode = "raise" if groups.rank in (0, last_rank) else ""
    try:
        rank = 0 if at_stage == 0 else last_rank
        fails_on_every_rank(engine, batch(), f"failed on rank {rank} (stage {at_stage}): stage {at_stage} raised "
                            "in its forward: ValueError: boom in Switch")
    finally:
        Switch.mode = ""
    assert math.isfinite(float(engine.train_batch(iter(batch(seed=1)))))


def test_an_exhausted_iterator_is_named_on_every_rank(groups: ProcessGroups) -> None:
    engine, _ = engine_with_switch(groups, 1)
    fails_on_every_rank(engine, batch()[:1], "(stage 0): drawing the batch raised StopIteration")


def test_a_changed_batch_shape_needs_dynamic_shape(groups: ProcessGroups) -> None:
    engine, _ = engine_with_switch(groups, 1)
    engine.train_batch(iter(batch(seq=6)))
    fails_on_every_rank(engine, batch(seq=5), "the batch's input shapes or dtypes changed since the first batch",
                        "dynamic_shape=True")


def test_dynamic_shape_trains_batches_of_changing_length(groups: ProcessGroups) -> None:
    """dynamic_shape=True: sequence lengths 6, 4, 6, 3 equal the same layers without a pipeline."""
    dp = groups.world_size // 2
    net = PipelineModule(specs(2, False), num_stages=2, loss_fn=loss_fn, seed_layers=True, base_seed=BASE_SEED,
                         dynamic_shape=True)
    engine, *_ = zeroshard.initialize(model=net, model_parameters=list(net.parameters()),
                                      config=pipe_config(1, clip=0.0))
    model = reference_model(2, False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for step, seq in enumerate([6, 4, 6, 3]):
        batches = [batch(seq, seed=10 * step + d) for d in range(dp)]
        got = float(engine.train_batch(iter(batches[groups.rank % dp])))
        want = 0.0
        for rank_batch in batches:
            for ids, labels in rank_batch:
                loss = loss_fn(reference_forward(model, 2, False, ids), labels)
                (loss / (GAS * dp)).backward()
                want += loss.item() / (GAS * dp)
        opt.step()
        opt.zero_grad()
        assert math.isclose(got, want, rel_tol=2e-6), f"step {step} (length {seq}): {got} != {want}"
