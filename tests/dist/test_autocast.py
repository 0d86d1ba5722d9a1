"""The `torch_autocast` section: fp32 parameters, the forward under torch.autocast, every stage.

The oracle is a plain torch loop (fp32 AdamW, the same forward under torch.autocast on every rank's
whole batch), as the stage-parity tests use plain torch.optim.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from engine_helpers import global_batches, make_config, make_model, rank_micro_batches

import zeroshard
from zeroshard.errors import ConfigError
from zeroshard.zero.init import GatheredParameters

STEPS = 3


def _autocast(dtype: str = "bfloat16", **extra: Any) -> dict[str, Any]:
    return {"enabled": True, "dtype": dtype, **extra}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_autocast_matches_torch_autocast_loop(groups: Any, stage: int) -> None:
    rank, world = groups.rank, groups.world_size
    data = global_batches(STEPS, 2 * world)
    model = make_model()
    ref = copy.deepcopy(model)
    engine, *_ = zeroshard.initialize(model=model, config=make_config(
        torch_autocast=_autocast(), zero_optimization={"stage": stage, "reduce_bucket_size": 500}))
    assert engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == torch.bfloat16
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for step, batch in enumerate(data):
        (x, y), = rank_micro_batches(batch, rank, world, 2, 1)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                want_here = ref(x, y)
            want = ref(*batch)
        # bf16 tolerance (docs: fp32 1e-5, bf16 2e-3 relative on losses)
        assert abs(loss.item() - want_here.item()) <= 2e-3 * abs(want_here.item()), (step, loss, want_here)
        want.backward()
        opt.step()
        opt.zero_grad()
    with GatheredParameters(list(engine.module.parameters())):
        assert all(p.dtype == torch.float32 for p in engine.module.parameters()), "parameters stay fp32"
        drift = max((a - b).abs().max().item() for a, b in zip(engine.module.parameters(), ref.parameters()))
    assert drift < 5e-2, drift


def test_forward_runs_in_the_autocast_dtype(groups: Any) -> None:
    lin = torch.nn.Linear(4, 4)
    engine, *_ = zeroshard.initialize(model=lin, config=make_config(torch_autocast=_autocast("torch.bfloat16")))
    assert engine(torch.ones(2, 4)).dtype == torch.bfloat16 and lin.weight.dtype == torch.float32
    plain, *_ = zeroshard.initialize(model=torch.nn.Linear(4, 4), config=make_config())
    assert plain(torch.ones(2, 4)).dtype == torch.float32 and not plain.torch_autocast_enabled()


def test_fp16_autocast_scales_the_loss(groups: Any) -> None:
    engine, *_ = zeroshard.initialize(model=torch.nn.Linear(4, 4), config=make_config(torch_autocast=_autocast("fp16")))
    assert engine.get_loss_scale() == 2.0**16, "fp16 autocast needs loss scaling, as DeepSpeed's GradScaler"


def test_bad_safe_module_is_refused_at_initialize(groups: Any) -> None:
    cfg = make_config(torch_autocast=_autocast(lower_precision_safe_modules=["torch.nn.Lineer"]))
    with pytest.raises(ConfigError, match=r"lower_precision_safe_modules\[0\].*torch.nn.Lineer"):
        zeroshard.initialize(model=torch.nn.Linear(4, 4), config=cfg)
