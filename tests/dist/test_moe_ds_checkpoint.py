"""A checkpoint real DeepSpeed 0.19.8 wrote for a legacy-MoE model (the committed fixture
tests/unit/fixtures/ds_moe: 2 ranks, ep_size 2, ZeRO 0 and 2) loads into a zeroshard engine at
this run's layout (1 rank ep 1, 2 ranks ep 2, 4 ranks ep 2 with each expert on an
expert-data-parallel pair) and another ZeRO stage: every weight, fp32 master fragment and Adam
moment the engine holds equals what the fixture's files hold for that parameter, experts by global
id (tests/unit/test_ds_moe_fixture.expected reads them directly). With load_optimizer_states=False,
the weights alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import zeroshard
from zeroshard.comm import ProcessGroups
from zeroshard.moe.layer import MoE
from zeroshard.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

UNIT = Path(__file__).resolve().parents[1] / "unit"
sys.path.insert(0, str(UNIT / "fixtures" / "ds_moe"))
sys.path.insert(0, str(UNIT))

import make_ds_moe_fixture as F  # noqa: E402  after the sys.path insert
import test_ds_moe_fixture as U  # noqa: E402  after the sys.path insert


@pytest.mark.parametrize("saved_stage, stage, with_optimizer", [(0, 2, True), (2, 1, True), (2, 0, True),
                                                               (2, 2, False)])
def test_deepspeed_moe_checkpoint_loads_weights_and_adam_state(groups: ProcessGroups, saved_stage: int, stage: int,
                                                               with_optimizer: bool) -> None:
    world, rank = groups.world_size, groups.rank
    ep = 2 if world % 2 == 0 else 1
    torch.manual_seed(5)  # values the load must overwrite
    model = F.Net(MoE, ep)
    engine, *_ = zeroshard.initialize(model=model, config=F.config(stage),
                                      model_parameters=split({"params": list(model.parameters()), "name": "p"}))
    engine.load_checkpoint(str(U.FIXTURE / f"s{saved_stage}"), load_optimizer_states=with_optimizer)
    assert engine.global_steps == 1
    want = U.expected(saved_stage)
    first = (rank % ep) * (F.EXPERTS // ep)

    def global_name(name: str) -> str:
        m = U.EXPERT.match(name)
        return name if m is None else f"{m['prefix']}.{first + int(m['j'])}.{m['rest']}"

    names = [global_name(n) for n, _ in engine.module.named_parameters()]
    for name, (_, p) in zip(names, engine.module.named_parameters(), strict=True):
        assert torch.equal(p.detach().reshape(-1), want[name]["weight"].reshape(-1)), name
    if not with_optimizer:  # the weights only (experts from their files), as load_optimizer_states=False asks
        return
    state = engine.state()
    assert state.masters or rank > 0, "rank 0 owns no optimizer fragment"  # at 3 ranks, rank 2 may own none
    for (i, off, n), master, st in zip(state.manifest.fragments[rank], state.masters, state.optimizer_states,
                                       strict=True):
        name = global_name(state.manifest.params[i].name)
        assert torch.equal(master, want[name]["master"][off : off + n]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key].reshape(-1), want[name][key][off : off + n]), (name, key)
        assert float(st["step"]) == 1.0
