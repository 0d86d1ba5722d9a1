"""Bad inputs found only at run time: each fails at initialize() with a message naming it."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import init_engine, make_config, make_model

import zeroshard
from zeroshard.errors import ConfigError


def test_different_configs_on_ranks_are_refused_naming_keys_and_ranks(groups) -> None:
    rank, world = groups.rank, groups.world_size
    last = world - 1
    cfg = make_config(zero_optimization={"stage": 1 if rank == 0 else 2},
                      optimizer={"type": "AdamW", "params": {"lr": 0.1 if rank == last else 0.01}})
    if world == 1:
        init_engine(make_model(), cfg)  # one rank cannot disagree with itself
        return
    with pytest.raises(ConfigError) as err:
        init_engine(make_model(), cfg)
    message = str(err.value)
    others = "rank 1" if world == 2 else f"ranks {list(range(1, world))}"
    assert f"zero_optimization.stage: rank 0 = 1, {others} = 2" in message, message
    firsts = "rank 0" if world == 2 else f"ranks {list(range(last))}"
    assert f"optimizer.params.lr: {firsts} = 0.01, rank {last} = 0.1" in message, message
    assert "same ds_config" in message


def test_same_config_passes_the_check(groups) -> None:
    engine = init_engine(make_model(), make_config(zero_optimization={"stage": 2}))
    x = torch.randint(0, 256, (2, 16))
    engine.backward(engine(x, x))
    engine.step()
    assert engine.global_steps == 1


@pytest.mark.parametrize("asks", ["model_parameters", "training_data", "scheduler"])
def test_no_optimizer_anywhere_fails_at_initialize_when_training(groups, asks: str) -> None:
    model = make_model()
    cfg = make_config(optimizer=None)
    kwargs: dict = {}
    if asks == "model_parameters":
        kwargs["model_parameters"] = model.parameters()
    elif asks == "training_data":
        kwargs["training_data"] = [torch.zeros(16, dtype=torch.long)] * 8
    else:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    with pytest.raises(ConfigError, match=r'no optimizer: the config has no "optimizer" section'):
        zeroshard.initialize(model=model, config=cfg, **kwargs)


def test_no_optimizer_and_no_training_arguments_is_an_inference_engine(groups) -> None:
    engine, optimizer, _, _ = zeroshard.initialize(model=make_model(), config=make_config(optimizer=None))
    assert optimizer is None
    with torch.no_grad():
        engine.eval()
        x = torch.randint(0, 256, (2, 16))
        assert torch.isfinite(engine(x, x)).all()


def test_config_mismatch_names_the_keys_on_the_first_line(groups) -> None:
    # torchrun's error summary shows only the first line of a rank's exception.
    rank, world = groups.rank, groups.world_size
    cfg = make_config(zero_optimization={"stage": 1 if rank == 0 else 2}, gradient_clipping=0.5 + rank,
                      steps_per_print=10 + rank, wall_clock_breakdown=rank == 0)
    if world == 1:
        init_engine(make_model(), cfg)
        return
    with pytest.raises(ConfigError) as err:
        init_engine(make_model(), cfg)
    first = str(err.value).splitlines()[0]
    assert first.startswith("the ranks resolved different configs in 4 key(s): "), first
    assert "gradient_clipping: rank 0 = 0.5, rank 1 = 1.5" in first, first
    assert "(and 1 more keys, below)" in first and "same ds_config" in first, first
    assert "zero_optimization.stage: rank 0 = 1" in str(err.value)
