"""`gradient_allreduce_op`: "mean" averages the ranks' gradients, "sum" adds them (no division by
the data-parallel size, the predivide factor unused), at ZeRO stages 0, 1 and 2 with each
reduction path (reduce-scatter, all-reduce, prescaled)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard


class LinearLoss(nn.Module):
    """loss = sum(w * x): the gradient on a rank is its own input."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()


def _inputs(rank: int, n: int) -> torch.Tensor:
    return torch.arange(1, n + 1, dtype=torch.float32) * (rank + 1)


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("op", ["mean", "sum"])
@pytest.mark.parametrize("reduce_scatter, prescale, predivide", [(True, False, 1.0), (False, False, 2.0),
                                                                 (False, True, 2.0)])
def test_mean_averages_and_sum_adds(groups, stage: int, op: str, reduce_scatter: bool, prescale: bool,
                                    predivide: float) -> None:
    world, n = groups.world_size, 6
    model = LinearLoss(n)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
              "gradient_allreduce_op": op, "prescale_gradients": prescale, "gradient_predivide_factor": predivide,
              "zero_optimization": {"stage": stage, "reduce_scatter": reduce_scatter}}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine, *_ = zeroshard.initialize(model=model, optimizer=optimizer, config=config)
    engine.backward(engine(_inputs(groups.rank, n)))
    engine.step()
    total = sum(_inputs(r, n) for r in range(world))
    want = -(total if op == "sum" else total / world)
    got = zeroshard.utils.safe_get_full_fp32_param(engine.module.weight)
    torch.testing.assert_close(got if got is not None else engine.module.weight.detach(), want)
    engine.destroy()


def test_sum_is_refused_where_it_is_not_built() -> None:
    from zeroshard.config import load_config
    from zeroshard.errors import ConfigError, NotSupportedError

    base = {"train_batch_size": 1, "gradient_allreduce_op": "sum"}
    with pytest.raises(ConfigError, match=r"^gradient_allreduce_op='sum' is not supported with ZeRO stage 3"):
        load_config({**base, "zero_optimization": {"stage": 3}}, dp_world_size=1)
    with pytest.raises(ConfigError, match=r"^gradient_allreduce_op='sum' is not supported with ZenFlow"):
        load_config({**base, "zero_optimization": {"stage": 2, "zenflow": {}}}, dp_world_size=1)
    with pytest.raises(ConfigError, match=r"^gradient_allreduce_op='sum' is not supported with DeepCompile"):
        load_config({**base, "compile": {"deepcompile": True}}, dp_world_size=1)
    with pytest.raises(NotSupportedError, match=r"gradient_allreduce_op='sum' with OneBitAdam"):
        load_config({**base, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}, dp_world_size=1)
    assert load_config({**base, "zero_optimization": {"stage": 2}}, dp_world_size=1).gradient_allreduce_op == "sum"
