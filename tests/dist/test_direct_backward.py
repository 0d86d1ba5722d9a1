"""A direct `loss.backward()` (DeepSpeed 0.19's "PyTorch-style backward") is a micro-batch like
`engine.backward(loss)`: the same division by gradient_accumulation_steps, the same accumulation
boundary and reduction, so the same trajectory bit for bit, at every stage and world size.
Under fp16 loss scaling a bare backward is refused (as DeepSpeed refuses it) and
`engine.scale(loss).backward()` is the direct form."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_helpers import global_batches, init_engine, make_config, make_model, rank_micro_batches

import zeroshard


def _config(stage: int, precision: str = "fp32") -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 300}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 100
    extra: dict[str, Any] = {}
    if precision == "bf16":
        extra["bf16"] = {"enabled": True}
    if precision == "fp16":
        extra["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return make_config(gradient_accumulation_steps=2, gradient_clipping=0.5, zero_optimization=zero, **extra)


def _train(stage: int, precision: str, how: str, rank: int, world: int) -> tuple[list[float], list[torch.Tensor]]:
    engine = init_engine(make_model(), _config(stage, precision))
    losses = []
    for batch in global_batches(3, 2 * 2 * world):
        for x, y in rank_micro_batches(batch, rank, world, 2, 2):
            loss = engine(x, y)
            if how == "engine":
                engine.backward(loss)
            elif how == "scale":
                engine.scale(loss).backward()
            else:
                loss.backward()
            engine.step()
            losses.append(loss.item())
    params = list(engine.module.parameters())
    with zeroshard.zero.GatheredParameters(params):  # whole values at stage 3 too
        return losses, [p.detach().clone() for p in params]


@pytest.mark.parametrize("stage,precision,how", [
    (0, "fp32", "direct"), (1, "fp32", "direct"), (2, "bf16", "direct"), (3, "fp32", "direct"),
    (2, "fp16", "scale"), (3, "bf16", "direct"),
])
def test_direct_backward_equals_engine_backward(groups: Any, stage: int, precision: str, how: str) -> None:
    rank, world = groups.rank, groups.world_size
    want_losses, want = _train(stage, precision, "engine", rank, world)
    got_losses, got = _train(stage, precision, how, rank, world)
    assert got_losses == want_losses
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"parameter {i} differs by {(a.float() - b.float()).abs().max():.3e}"
    # the runs trained: the weights moved from their initial values
    assert any(not torch.equal(a, b) for a, b in zip(got, make_model().parameters()))


def test_fp16_bare_backward_is_refused(groups: Any) -> None:
    engine = init_engine(make_model(), _config(2, "fp16"))
    x = torch.randint(0, 50, (2, 8))
    with pytest.raises(RuntimeError, match=r"engine.scale\(loss\).backward\(\)"):
        engine(x, x).backward()


def test_step_after_forward_without_backward_is_refused(groups: Any) -> None:
    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)),
                                      config=make_config(zero_optimization={"stage": 2}))
    x = torch.randn(2, 4)
    engine(x)
    with pytest.raises(RuntimeError, match=r"without a backward"):
        engine.step()
    engine(x).pow(2).mean().backward()  # a direct backward of a new forward is a micro-batch
    engine.step()
    with torch.no_grad():
        engine(x)  # an evaluation forward does not need a backward
    engine.step()
