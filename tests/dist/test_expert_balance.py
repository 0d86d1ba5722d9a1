"""`expert_parallel.load_balance_coeff`: auxiliary-loss-free balancing of DeepSeek-V3-style routers
(Note: [expert bias balancing] in moe/balance.py), against a one-process oracle written here.

The oracle (test_autoep's: the unmodified model on every rank's micro-batches, clipped as the
engine clips) counts each router's chosen experts with its own hook and, after each optimizer
step, moves each bias by coeff * sign(mean load - load), centred. The engine must give the same
losses and the same biases at every step, with and without expert parallelism, at ZeRO 1 and 3,
with gradient accumulation (GAS 2: the counts span the step's micro-batches). Evaluation forwards
and activation-checkpointing recomputes do not count; the biases resume from a checkpoint; routers without a bias, and a
coefficient that is not positive, are refused at initialize.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_autoep import STEPS, batches, check_losses, config, reference, train_engine, train_oracle
from torch import Tensor, nn

import zeroshard
from zeroshard.comm import ProcessGroups
from zeroshard.errors import ConfigError

transformers = pytest.importorskip("transformers")

COEFF = 0.01
BIAS = "e_score_correction_bias"


def biases(model: nn.Module) -> list[Tensor]:
    return [b.detach().clone() for name, b in model.named_buffers() if name.endswith(BIAS)]


def oracle_run(model: nn.Module, data: list[Any], world: int, stage: int,
               ep: int) -> tuple[list[list[float]], list[list[Tensor]]]:
    """Losses per step and rank (test_autoep's oracle), and the biases after every step, each moved by
    the rule above from this oracle's own counts of the routers' choices."""
    routers = [m for m in model.modules() if isinstance(getattr(m, BIAS, None), Tensor)]
    counts = [torch.zeros(r.e_score_correction_bias.numel(), dtype=torch.float64) for r in routers]

    def counter(i: int) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            ids = out[2]  # DeepseekV3TopkRouter returns (logits, weights, indices)
            counts[i].index_add_(0, ids.reshape(-1), torch.ones(ids.numel(), dtype=torch.float64))
        return hook

    seen: list[list[Tensor]] = []

    @torch.no_grad()
    def update() -> None:
        for router, load in zip(routers, counts):
            step_delta = COEFF * torch.sign(load.mean() - load)
            router.e_score_correction_bias += (step_delta - step_delta.mean()).float()
            load.zero_()
        seen.append(biases(model))

    handles = [r.register_forward_hook(counter(i)) for i, r in enumerate(routers)]
    losses = train_oracle(model, data, world, range(STEPS), stage=stage, ep=ep, after_step=update)
    for h in handles:
        h.remove()
    return losses, seen


def balanced_config(stage: int, ep: int, **extra: Any) -> dict[str, Any]:
    cfg = config(stage, ep, **extra)
    cfg["expert_parallel"] = {"enabled": ep > 1, "autoep_size": ep, "load_balance_coeff": COEFF}
    return cfg


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("ep_kind", ["none", "world"])
def test_biases_and_losses_equal_the_oracle(groups: ProcessGroups, stage: int, ep_kind: str) -> None:
    world, rank = groups.world_size, groups.rank
    ep = world if ep_kind == "world" else 1
    if ep_kind == "world" and (world == 1 or 4 % world):
        pytest.skip("expert parallelism over the world needs 2 or 4 ranks (4 experts)")
    data = batches(world)
    oracle = reference("deepseek_v3")
    before = biases(oracle)
    engine, *_ = zeroshard.initialize(model=reference("deepseek_v3"), config=balanced_config(stage, ep))
    assert engine.expert_balance is not None
    got_biases = []
    got = []
    for step in range(STEPS):
        got += train_engine(engine, data, rank, range(step, step + 1))
        got_biases.append(biases(engine.module))
    want, want_biases = oracle_run(oracle, data, world, stage, ep)
    check_losses(got, want, rank, f"stage {stage} ep {ep}")
    assert engine.expert_balance.updates == STEPS  # once per optimizer step, not per micro-batch
    for step, (g, w) in enumerate(zip(got_biases, want_biases)):
        for layer, (gb, wb) in enumerate(zip(g, w)):
            assert torch.allclose(gb, wb, rtol=0, atol=1e-7), f"step {step} layer {layer}: {gb} vs {wb}"
    moved = [not torch.equal(a, b) for a, b in zip(before, got_biases[-1])]
    assert all(moved), "every router's bias moved"


def test_eval_and_recompute_do_not_count(groups: ProcessGroups) -> None:
    model = reference("deepseek_v3")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = zeroshard.initialize(model=model, config=balanced_config(1, 1))
    x = batches(groups.world_size)[0][0][groups.rank]
    with torch.no_grad():
        engine.eval()
        engine(input_ids=x, labels=x)
    engine.train()
    assert engine.expert_balance._counts is None, "an evaluation forward was counted"
    loss = engine(input_ids=x, labels=x).loss
    counted = engine.expert_balance._counts.clone()
    engine.backward(loss)  # the checkpointed layers run their forward again here
    assert torch.equal(engine.expert_balance._counts, counted), "the recompute was counted"
    routes = x.numel() * model.config.num_experts_per_tok
    assert counted.sum(dim=1).tolist() == [routes] * counted.shape[0]


def test_biases_resume_from_a_checkpoint(groups: ProcessGroups, shared_dir: Path) -> None:
    data = batches(groups.world_size)
    engine, *_ = zeroshard.initialize(model=reference("deepseek_v3"), config=balanced_config(1, 1))
    train_engine(engine, data, groups.rank, range(2))
    engine.save_checkpoint(str(shared_dir), tag="t")
    trained = biases(engine.module)
    fresh, *_ = zeroshard.initialize(model=reference("deepseek_v3"), config=balanced_config(1, 1))
    assert not all(torch.equal(a, b) for a, b in zip(trained, biases(fresh)))
    fresh.load_checkpoint(str(shared_dir), tag="t")
    assert all(torch.equal(a, b) for a, b in zip(trained, biases(fresh)))


def test_refusals_name_the_key(groups: ProcessGroups) -> None:
    with pytest.raises(ConfigError, match="load_balance_coeff.*no router with a selection bias"):
        zeroshard.initialize(model=reference("mixtral"), config=balanced_config(1, 1))
    bad = balanced_config(1, 1)
    bad["expert_parallel"]["load_balance_coeff"] = 0.0
    with pytest.raises(ConfigError, match="load_balance_coeff must be > 0"):
        zeroshard.initialize(model=reference("deepseek_v3"), config=bad)
