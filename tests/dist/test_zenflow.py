"""ZenFlow (`zero_optimization.zenflow`) follows DeepSpeed 0.19.8's rule (Note: [zenflow rule] in
zeroshard/zero/offload/zenflow.py), checked against `zenflow_reference` below.

The reference is plain torch over whole parameters: each rank's gradient computed on its own
micro-batch and summed in rank order (the engine's all-reduce of two ranks gives the same
bits), averaged and divided by update_interval; per 2-D weight the top-k columns by the L1
norm of that gradient over dim 0, chosen by torch.topk, every 1-D parameter whole; the gradient
accumulated in fp32; the CPU AdamW on fp32 masters at the rule's steps with step count k + 1,
cast into the model except the selected columns; torch's AdamW arithmetic on the selected columns
every step after the warm-up. Run at world sizes 1 (plain pytest) and 2 (torchrun), ZeRO stages
1 and 2, fp32; the intervals make both the CPU step and a reselection happen several times.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from engine_helpers import (
    MICRO,
    assert_params_close,
    capture_zeroshard_log,
    gathered_snapshot,
    global_batches,
    init_engine,
    make_config,
    make_model,
    rank_micro_batches,
    skip_repeat_at_three,
    train_engine,
)
from torch import Tensor, nn
from torch.optim.adamw import adamw

from zeroshard.config import load_config
from zeroshard.errors import ConfigError, NotSupportedError
from zeroshard.zero.offload.zenflow import ZenFlowStep

STEPS = 12
LR, WD = 1e-2, 0.01
CASES = {  # name -> (topk_ratio, select_interval, update_interval, full_warm_up_rounds)
    "intervals": (0.25, 4, 2, 0),  # selections at 0, 4, 8; CPU steps at every odd k
    "warm-up": (0.25, 5, 2, 3),  # CPU steps at 0-2, 4, 6, 8, 10 and 9 (before the reselection at 10)
}
AUTO_CASES = {  # name -> (zenflow section, loader steps per epoch, reference's (topk, select, update, warmup, ratio))
    # update_interval "auto": CPU steps (1 rank) at 2, 3, 5, 7, 9, 11: intervals of 1 and 2 steps
    "auto update": ({"topk_ratio": 0.1, "select_strategy": "step", "select_interval": 5, "update_interval": "auto"},
                    None, (0.1, 5, None, 0, 0.99)),
    "auto update, warm-up": ({"topk_ratio": 0.25, "select_strategy": "step", "select_interval": 4,
                              "update_interval": "auto", "full_warm_up_rounds": 2, "auto_ratio": 0.5},
                             None, (0.25, 4, None, 2, 0.5)),
    # an epoch of 3 steps (the loader's length): selections every 2 epochs = 6 steps
    "epoch": ({"topk_ratio": 0.25, "select_strategy": "epoch", "select_interval": 2, "update_interval": 2},
              3, (0.25, 6, 2, 0, 0.99)),
    # DeepSpeed's defaults: "auto" = one epoch (4 steps), update_interval "auto"
    "defaults, loader": ({}, 4, (0.1, 4, None, 0, 0.99)),
    # ... without a loader: selected once
    "defaults": ({}, None, (0.1, 0, None, 0, 0.99)),
}


def config(stage: int, topk: float, select: int, update: int, warmup: int, gas: int = 1) -> dict[str, Any]:
    return zen_config(stage, {"topk_ratio": topk, "select_strategy": "step", "select_interval": select,
                              "update_interval": update, "full_warm_up_rounds": warmup}, gas)


def zen_config(stage: int, zenflow: dict[str, Any], gas: int = 1) -> dict[str, Any]:
    return make_config(gradient_accumulation_steps=gas, zero_optimization={
        "stage": stage, "reduce_bucket_size": 500, "offload_optimizer": {"device": "cpu"}, "zenflow": zenflow})


def loader_data(epoch_steps: int | None, world: int) -> dict[str, Any]:
    """initialize()'s training_data giving each rank `epoch_steps` micro-batches (none: no loader)."""
    if epoch_steps is None:
        return {}
    n = epoch_steps * MICRO * world
    return {"training_data": torch.utils.data.TensorDataset(torch.zeros(n, 1))}


def zenflow_reference(model: nn.Module, batches: list[tuple[Tensor, Tensor]], world: int, topk: float,
                      select: int, update: int | None, warmup: int, fused: bool, gas: int = 1,
                      auto_ratio: float = 0.99, lag: int = 1, schedule: list[int] | None = None,
                      bf16: bool = False, fp32_selective: bool = False, clip: float = 0.0,
                      clip_selective: bool = True, norms: dict[str, list[float]] | None = None,
                      ) -> tuple[list[list[float]], list[list[Tensor]]]:
    """DeepSpeed's ZenFlow rule, written out: per-step losses of each rank (its last micro-batch's)
    and the weights after each step. `gas` > 1: stage 2's order, each micro-batch's loss / gas
    summed over the ranks, then over the micro-batches; a ZenFlow step is an optimizer step.

    `update` None: update_interval "auto" (Note: [zenflow auto update]): the gradient not divided,
    the CPU step on the mean of the accumulated gradients, at the step after one whose sums called
    for it (`lag` 0 perturbs that: the same step). `schedule` collects the steps that end with a
    CPU step. `bf16`: the model in bf16, its gradients summed in fp32 (exact in any order), fp32
    masters and accumulator; the selective AdamW steps the bf16 values with the gradient cast to
    bf16 and bf16 moments (DeepSpeed's ZenFlowSelectiveAdamW on bf16 parameters), its step count
    in fp32 (`fp32_selective` perturbs that: fp32 values and moments, rounded into the model).

    `clip` > 0: gradient_clipping (Note: [zenflow clip]): the CPU step's gradient times
    min(1, clip / (its norm + 1e-6)), and the selective step's gradient times the same factor of
    the norm of the step's averaged gradient (before the division by update_interval); squares
    summed in float64. `clip_selective` False: DeepSpeed's rule, the selective step unclipped.
    `norms` collects the step norms ("step") and the CPU steps' ("cpu")."""
    model = copy.deepcopy(model).to(torch.bfloat16) if bf16 else copy.deepcopy(model)
    params = list(model.parameters())
    master = [nn.Parameter(p.detach().float().clone()) for p in params]
    opt = torch.optim.AdamW(master, lr=LR, weight_decay=WD, fused=fused)
    acc = [torch.zeros_like(m) for m in master]  # fp32
    cols: list[Tensor | None] = [None] * len(params)  # selected columns (2-D) / None
    exp_avg: list[Tensor] = []
    exp_avg_sq: list[Tensor] = []
    sel_step = [torch.zeros(()) for _ in params]
    accumulated, interval, pending = 0, 0, False
    avg_critic = [torch.zeros((), dtype=torch.float64) for _ in params]
    non_critic = [torch.zeros((), dtype=torch.float64) for _ in params]
    losses, weights = [], []
    for k, batch in enumerate(batches):
        total: list[Tensor] | None = None
        rank_micro = [rank_micro_batches(batch, r, world, MICRO, gas) for r in range(world)]
        for m in range(gas):
            micro_sum: list[Tensor] | None = None
            rank_losses = []
            for r in range(world):
                x, y = rank_micro[r][m]
                loss = model(x, y)
                grads = [g.float() for g in torch.autograd.grad(loss * (1.0 / gas) if gas != 1 else loss, params)]
                micro_sum = list(grads) if micro_sum is None else [t + g for t, g in zip(micro_sum, grads)]
                rank_losses.append(loss.item())
            assert micro_sum is not None
            total = micro_sum if total is None else [t + g for t, g in zip(total, micro_sum)]
        assert total is not None
        grads = [(t * (1.0 / world) if world != 1 else t) / (update or 1) for t in total]
        step_norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in total)) * (1.0 / world)
        sel_coef = _clip_factor(clip, step_norm) if clip_selective else 1.0
        if norms is not None:
            norms.setdefault("step", []).append(step_norm)
        with torch.no_grad():
            fire = False
            if update is None:  # the adaptive interval's start of step
                fire, pending = pending, False
                if fire:
                    interval, non_critic = 0, [torch.zeros((), dtype=torch.float64) for _ in params]
                interval += 1
            if k >= warmup and (k == warmup or (select > 0 and k % select == 0)):  # select
                if k > 0:
                    for m, p in zip(master, params):
                        m.copy_(p)
                for i, (p, g) in enumerate(zip(params, grads)):
                    if p.dim() == 2:
                        n = max(1, int(p.shape[1] * topk))
                        cols[i] = torch.topk(g.abs().sum(dim=0), n).indices.sort().values
                moments = torch.float32 if fp32_selective else None
                exp_avg = [torch.zeros_like(_selected(p, c), dtype=moments) for p, c in zip(params, cols)]
                exp_avg_sq = [torch.zeros_like(_selected(p, c), dtype=moments) for p, c in zip(params, cols)]
            if update is None and k >= warmup:  # the adaptive interval's sums over whole 2-D weights
                calls, two_d = 0, 0
                for i, (p, g) in enumerate(zip(params, grads)):
                    if p.dim() == 2:
                        total_sum = g.double().abs().sum()
                        critic = _selected(g, cols[i]).double().abs().sum()
                        avg_critic[i] = (avg_critic[i] * (interval - 1) + critic) / interval / (topk * 10)
                        non_critic[i] = non_critic[i] + (total_sum - critic) / ((1 - topk) * 10)
                        calls += int(non_critic[i] >= avg_critic[i])
                        two_d += 1
                pending = two_d > 0 and calls >= int(auto_ratio * two_d)
                if lag == 0:  # the perturbed reading: the decision acts on its own step
                    fire, pending = pending, False
                    if fire:
                        interval, non_critic = 0, [torch.zeros((), dtype=torch.float64) for _ in params]
            for a, g in zip(acc, grads):
                a.add_(g)
            accumulated += 1
            due = fire if update is None else (k + 1 - warmup) % update == 0
            if k + 1 <= warmup or due or (select > 0 and (k + 1) % select == 0):
                if schedule is not None:
                    schedule.append(k)
                kept = [_selected(p, c).clone() for p, c in zip(params, cols)] if k >= warmup else None
                given = [a / accumulated if update is None and accumulated != 1 else a.clone() for a in acc]
                cpu_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in given))
                if norms is not None:
                    norms.setdefault("cpu", []).append(cpu_norm)
                cpu_coef = _clip_factor(clip, cpu_norm)
                for m, given_grad in zip(master, given):
                    m.grad = given_grad * cpu_coef if cpu_coef != 1.0 else given_grad
                    state = opt.state[m]
                    if not state:
                        state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(m),
                                     exp_avg_sq=torch.zeros_like(m))
                    state["step"].fill_(float(k))  # DeepSpeed's CPU step id is k + 1
                opt.step()
                for i, (p, m, a) in enumerate(zip(params, master, acc)):
                    p.copy_(m)
                    if kept is not None:
                        _set_selected(p, cols[i], kept[i])
                    a.zero_()
                accumulated = 0
            if k >= warmup:  # the selective AdamW
                for i, (p, g) in enumerate(zip(params, grads)):
                    values = _selected(p, cols[i]).clone()
                    values = values.float() if fp32_selective else values
                    sel_grad = _selected(g, cols[i])
                    sel_grad = sel_grad * sel_coef if sel_coef != 1.0 else sel_grad
                    adamw([values], [sel_grad.to(values.dtype)], [exp_avg[i]], [exp_avg_sq[i]], [],
                          [sel_step[i]], foreach=False, amsgrad=False, beta1=0.9, beta2=0.999, lr=LR,
                          weight_decay=WD, eps=1e-8, maximize=False)
                    _set_selected(p, cols[i], values)
        losses.append(rank_losses)
        weights.append([p.detach().float().clone() for p in params])
    return losses, weights


def _clip_factor(clip: float, norm: float) -> float:
    return min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0


def _selected(t: Tensor, columns: Tensor | None) -> Tensor:
    return t[:, columns] if t.dim() == 2 else t


def _set_selected(t: Tensor, columns: Tensor | None, values: Tensor) -> None:
    if t.dim() == 2:
        t[:, columns] = values.to(t.dtype)
    else:
        t.copy_(values)


def _fused(engine: Any) -> bool:
    inner = engine.optimizer.optimizer
    assert isinstance(inner, ZenFlowStep), f"expected ZenFlow's step, got {type(inner).__name__}"
    return bool(inner.inner.defaults.get("fused"))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_matches_reference(groups, stage: int, case: str) -> None:
    skip_repeat_at_three(groups.world_size, stage)
    rank, world = groups.rank, groups.world_size
    topk, select, update, warmup = CASES[case]
    model = make_model()
    batches = global_batches(STEPS, MICRO * world)
    engine = init_engine(copy.deepcopy(model), config(stage, topk, select, update, warmup))
    losses, got = train_engine(engine, batches, rank, world)
    want_losses, want = zenflow_reference(model, batches, world, topk, select, update, warmup, _fused(engine))
    for k in range(STEPS):
        assert_params_close(got[k], want[k], 0.0, f"stage {stage}, {case}, weights after step {k + 1}")
    assert losses == [per_rank[rank] for per_rank in want_losses]


@pytest.mark.parametrize("case", list(AUTO_CASES))
@pytest.mark.parametrize("stage", [1, 2])
def test_auto_and_epoch_match_reference(groups, stage: int, case: str) -> None:
    """select_strategy "epoch" / "auto" and update_interval "auto" (Note: [zenflow auto update]);
    16 steps, so the adaptive interval calls several CPU steps ("auto update" at 1 rank: at steps
    2, 3, 5, 7, 9, 11, 12, 14, intervals of 1 and 2)."""
    skip_repeat_at_three(groups.world_size, stage)
    rank, world = groups.rank, groups.world_size
    zenflow, epoch_steps, (topk, select, update, warmup, ratio) = AUTO_CASES[case]
    model = make_model()
    batches = global_batches(16, MICRO * world)
    engine = init_engine(copy.deepcopy(model), zen_config(stage, zenflow), **loader_data(epoch_steps, world))
    _, got = train_engine(engine, batches, rank, world)
    schedule: list[int] = []
    _, want = zenflow_reference(model, batches, world, topk, select, update, warmup, _fused(engine),
                                auto_ratio=ratio, schedule=schedule)
    for k in range(len(batches)):
        assert_params_close(got[k], want[k], 0.0, f"stage {stage}, {case}, weights after step {k + 1}")
    if update is None:  # the adaptive interval itself called CPU steps (not the warm-up's or a reselection's)
        called = [k for k in schedule if k >= warmup and not (select > 0 and (k + 1) % select == 0)]
        assert len(called) >= 3, schedule


BF16_CASES = {"intervals": (CASES["intervals"] + (None,), {}),
              "auto update": ((0.1, 5, None, 0), AUTO_CASES["auto update"][0])}


@pytest.mark.parametrize("case", list(BF16_CASES))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_matches_reference(groups, stage: int, case: str) -> None:
    """bf16 weights, fp32 masters and accumulator in host memory; the selected columns stepped in
    bf16 (DeepSpeed's behaviour). Stepping them in fp32 and rounding gives other weights."""
    skip_repeat_at_three(groups.world_size, stage)
    rank, world = groups.rank, groups.world_size
    args, zenflow = BF16_CASES[case]
    topk, select, update, warmup = args[:4]
    model = make_model()
    batches = global_batches(STEPS, MICRO * world)
    cfg = zen_config(stage, zenflow) if zenflow else config(stage, topk, select, update, warmup)  # type: ignore[arg-type]
    cfg["bf16"] = {"enabled": True}
    engine = init_engine(copy.deepcopy(model), cfg)
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    _, got = train_engine(engine, batches, rank, world)
    _, want = zenflow_reference(model, batches, world, topk, select, update, warmup, _fused(engine), bf16=True)
    for k in range(STEPS):
        assert_params_close(got[k], want[k], 0.0, f"bf16, stage {stage}, {case}, weights after step {k + 1}")
    _, fp32_step = zenflow_reference(model, batches, world, topk, select, update, warmup, _fused(engine), bf16=True,
                                     fp32_selective=True)
    assert any(not torch.equal(a, b) for a, b in zip(want[-1], fp32_step[-1]))


def test_auto_rules_can_fail(groups) -> None:
    """The comparisons above can fail: the adaptive interval acting on the step that decided
    (no lag), and an "epoch" interval read as steps, give other weights than the rule."""
    world = groups.world_size
    model = make_model()
    batches = global_batches(16, MICRO * world)
    _, rule = zenflow_reference(model, batches, world, 0.1, 5, None, 0, fused=False)
    _, no_lag = zenflow_reference(model, batches, world, 0.1, 5, None, 0, fused=False, lag=0)
    assert any(not torch.equal(a, b) for a, b in zip(rule[-1], no_lag[-1]))
    _, epochs = zenflow_reference(model, batches, world, 0.25, 6, 2, 0, fused=False)
    _, steps = zenflow_reference(model, batches, world, 0.25, 2, 2, 0, fused=False)
    assert any(not torch.equal(a, b) for a, b in zip(epochs[-1], steps[-1]))


CLIP = 0.3  # below the tiny GPT's step norms at 1-3 ranks (about 0.4-1.4), asserted per run
CLIP_CASES = {  # name -> (topk, select, update, warmup, gradient_clipping, bf16)
    "clips": (*CASES["intervals"], CLIP, False),
    "clips, auto update, warm-up": (0.25, 4, None, 2, CLIP, False),
    "clips, bf16": (*CASES["intervals"], CLIP, True),
    "does not clip": (*CASES["intervals"], 10.0, False),
}


def clip_config(stage: int, case: str) -> dict[str, Any]:
    topk, select, update, warmup, clip, bf16 = CLIP_CASES[case]
    interval: int | str = "auto" if update is None else update
    cfg = zen_config(stage, {"topk_ratio": topk, "select_strategy": "step", "select_interval": select,
                             "update_interval": interval, "full_warm_up_rounds": warmup})
    cfg["gradient_clipping"] = clip
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


@pytest.mark.parametrize("case", list(CLIP_CASES))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clipping_matches_reference(groups, stage: int, case: str) -> None:
    """gradient_clipping (Note: [zenflow clip]): the CPU step's accumulated gradient clipped by
    its own norm, the selected columns' gradient by the step's norm. With CLIP the norms exceed
    the threshold (both kinds, so both factors are below 1 somewhere); with 10 none does, and
    the run is the unclipped rule's."""
    skip_repeat_at_three(groups.world_size, stage)
    rank, world = groups.rank, groups.world_size
    topk, select, update, warmup, clip, bf16 = CLIP_CASES[case]
    model = make_model()
    batches = global_batches(STEPS, MICRO * world)
    engine = init_engine(copy.deepcopy(model), clip_config(stage, case))
    losses, got = train_engine(engine, batches, rank, world)
    norms: dict[str, list[float]] = {}
    want_losses, want = zenflow_reference(model, batches, world, topk, select, update, warmup, _fused(engine),
                                          bf16=bf16, clip=clip, norms=norms)
    for k in range(STEPS):
        assert_params_close(got[k], want[k], 0.0, f"stage {stage}, {case}, weights after step {k + 1}")
    assert losses == [per_rank[rank] for per_rank in want_losses]
    if clip == CLIP:
        assert any(n > clip for n in norms["step"]) and any(n > clip for n in norms["cpu"]), norms
    else:
        assert max(norms["step"] + norms["cpu"]) < clip, norms
        _, unclipped = zenflow_reference(model, batches, world, topk, select, update, warmup, _fused(engine),
                                         bf16=bf16)
        assert all(torch.equal(a, b) for a, b in zip(want[-1], unclipped[-1]))


def test_clipping_rules_can_fail(groups) -> None:
    """The comparison above can fail: without clipping, and with DeepSpeed's rule (the selected
    columns unclipped), the weights differ from the rule's."""
    world = groups.world_size
    topk, select, update, warmup = CASES["intervals"]
    model = make_model()
    batches = global_batches(STEPS, MICRO * world)
    args = (model, batches, world, topk, select, update, warmup)
    _, rule = zenflow_reference(*args, fused=False, clip=CLIP)
    _, none = zenflow_reference(*args, fused=False)
    _, deepspeed = zenflow_reference(*args, fused=False, clip=CLIP, clip_selective=False)
    for other in (none, deepspeed):
        assert any(not torch.equal(a, b) for a, b in zip(rule[-1], other[-1]))
    # DeepSpeed's rule clips the CPU step alike: it differs from no clipping too
    assert any(not torch.equal(a, b) for a, b in zip(deepspeed[-1], none[-1]))


def test_gradient_accumulation(groups) -> None:
    """Two micro-batches per optimizer step at stage 2: a ZenFlow step is an optimizer step, on the
    gradient averaged over its micro-batches (DeepSpeed counts micro-steps instead)."""
    rank, world = groups.rank, groups.world_size
    topk, select, update, warmup = CASES["intervals"]
    model = make_model()
    batches = global_batches(8, MICRO * world * 2)
    engine = init_engine(copy.deepcopy(model), config(2, topk, select, update, warmup, gas=2))
    _, got = train_engine(engine, batches, rank, world)
    _, want = zenflow_reference(model, batches, world, topk, select, update, warmup, _fused(engine), gas=2)
    for k in range(len(batches)):
        assert_params_close(got[k], want[k], 0.0, f"gradient accumulation 2, weights after step {k + 1}")


def test_rule_is_not_plain_offload(groups) -> None:
    """The comparison above can fail: at step 0 the reference moves only the selected columns of
    each 2-D weight (a warm-up step moves all of them, by the same first AdamW step), and 1-D
    parameters whole in both."""
    world = groups.world_size
    model = make_model()
    batches = global_batches(2, MICRO * world)
    _, zen = zenflow_reference(model, batches, world, 0.25, 4, 2, 0, fused=False)
    _, warm = zenflow_reference(model, batches, world, 0.25, 4, 2, 2, fused=False)  # CPU steps only
    for p, z, w in zip(model.parameters(), zen[0], warm[0]):
        moved = (z != p.detach()).any(dim=0) if p.dim() == 2 else (z != p.detach())
        if p.dim() == 2:
            assert int(moved.sum()) == max(1, int(p.shape[1] * 0.25)), "only the top-k columns move"
            assert not torch.equal(z, w)
        else:
            assert torch.equal(z, w)


def _load(zenflow: dict[str, Any], stage: int = 2, **zero: Any) -> Any:
    offload = zero.pop("offload_optimizer", {"device": "cpu"})
    return load_config({"train_batch_size": 2, "gradient_clipping": 0.0, "zero_optimization": {
        "stage": stage, "offload_optimizer": offload, "zenflow": zenflow, **zero}}, dp_world_size=1)


STEP = {"select_strategy": "step", "select_interval": 4, "update_interval": 2}


def test_config_as_deepspeed() -> None:
    cfg = _load(STEP).zero_optimization.zenflow
    assert cfg.enabled and (cfg.topk_ratio, cfg.full_warm_up_rounds, cfg.overlap_step) == (0.1, 0, False)
    assert not load_config({"train_batch_size": 2}, dp_world_size=1).zero_optimization.zenflow.enabled
    with pytest.raises(ConfigError, match=r"zenflow\.topk_ratio: got 1\.0"):
        _load({**STEP, "topk_ratio": 1.0})
    with pytest.raises(ConfigError, match="select interval must be greater or equal to update interval"):
        _load({**STEP, "select_interval": 1})
    with pytest.raises(ConfigError, match=r"update_interval: got 0, expected an integer >= 1"):
        _load({**STEP, "update_interval": 0})
    with pytest.raises(ConfigError, match="must be used with CPU offload"):
        _load(STEP, offload_optimizer={"device": "none"})
    defaults = _load({}).zero_optimization.zenflow
    assert (defaults.select_strategy, defaults.select_interval, defaults.update_interval) == ("auto", "auto", "auto")
    assert defaults.select_steps == 0  # no epoch length yet: select once
    assert _load({"select_strategy": "epoch", "select_interval": 3, "update_interval": 2,
                  "steps_per_epoch": 5}).zero_optimization.zenflow.select_steps == 15
    with pytest.raises(ConfigError, match=r'select_interval: got 4 with select_strategy "auto"'):
        _load({"select_interval": 4})
    with pytest.raises(ConfigError, match=r'"auto" goes with select_strategy "auto" only .* number of epochs'):
        _load({"select_strategy": "epoch"})
    with pytest.raises(ConfigError, match=r"select_interval: 2 steps \(1 epochs of 2 steps\), below update_interval"):
        _load({"select_strategy": "epoch", "select_interval": 1, "update_interval": 3, "steps_per_epoch": 2})


def test_epoch_length(groups) -> None:
    """The "epoch" strategy's length: the loader's, in optimizer steps; without one, a note and
    a single selection; an epoch interval below update_interval is refused once known."""
    world = groups.world_size
    engine = init_engine(make_model(), zen_config(2, {}, gas=2), **loader_data(6, world))
    assert engine.zs_config.zero_optimization.zenflow.steps_per_epoch == 3  # 6 micro-batches, 2 per step
    with capture_zeroshard_log() as log:
        engine = init_engine(make_model(), zen_config(2, {}))
    assert engine.zs_config.zero_optimization.zenflow.select_steps == 0
    assert groups.rank != 0 or "the columns are selected once, after the warm-up (as DeepSpeed does)" in log.getvalue()
    epoch = {"select_strategy": "epoch", "select_interval": 1, "update_interval": 4}
    with pytest.raises(ConfigError, match=r"select_interval: 3 steps \(1 epochs of 3 steps\), below update_interval"):
        init_engine(make_model(), zen_config(2, epoch), **loader_data(3, world))


@pytest.mark.parametrize("zenflow, stage, match", [
    ({**STEP, "offload": True}, 2, r"zenflow\.offload=true\. ZenFlow's selective optimizer states"),
    (STEP, 0, r"zenflow with ZeRO stage 0: not implemented"),
])
def test_refused_by_name(zenflow: dict[str, Any], stage: int, match: str) -> None:
    with pytest.raises(NotSupportedError, match=match):
        _load(zenflow, stage=stage)


def test_refused_pairings() -> None:
    clipped = load_config({"train_batch_size": 2, "zero_optimization": {  # gradient_clipping 1.0, HF's default
        "stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": STEP}}, dp_world_size=1)
    assert clipped.gradient_clipping == 1.0 and clipped.zero_optimization.zenflow.enabled
    with pytest.raises(NotSupportedError, match=r"zenflow with fp16 training: not implemented"):
        load_config({"train_batch_size": 2, "gradient_clipping": 0.0, "fp16": {"enabled": True},
                     "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": STEP}},
                    dp_world_size=1)
    with pytest.raises(NotSupportedError, match=r"zenflow with bf16\.bf16_master_weights_and_grads: not implemented"):
        load_config({"train_batch_size": 2, "gradient_clipping": 0.0,
                     "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
                     "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": STEP}},
                    dp_world_size=1)
    with pytest.raises(NotSupportedError, match=r"zenflow with offload_optimizer\.delayed_update"):
        _load(STEP, offload_optimizer={"device": "cpu", "delayed_update": True})
    with pytest.raises(NotSupportedError, match=r"zenflow with zero_optimization\.offload_param at ZeRO stage 3"):
        _load(STEP, stage=3, offload_param={"device": "cpu"})
    with pytest.raises(NotSupportedError, match=r"zenflow with zero_optimization\.offload_optimizer\.ratio at ZeRO"):
        _load(STEP, stage=3, offload_optimizer={"device": "cpu", "ratio": 0.5})


RESUME = {  # name -> (zenflow section, loader steps per epoch, bf16)
    "intervals": ({"topk_ratio": 0.25, "select_strategy": "step", "select_interval": 4, "update_interval": 2}, None,
                  False),
    "auto update": (AUTO_CASES["auto update"][0], None, False),
    "defaults, loader": ({}, 4, False),
    "auto update, bf16": (AUTO_CASES["auto update"][0], None, True),
}


def resume_config(stage: int, case: str) -> dict[str, Any]:
    zenflow, _, bf16 = RESUME[case]
    return {**zen_config(stage, zenflow), **({"bf16": {"enabled": True}} if bf16 else {})}


@pytest.mark.parametrize("case", list(RESUME))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpoint_resumes_exactly(groups, shared_dir, stage: int, case: str) -> None:
    """Saved after 7 steps (the selection, the selective AdamW's moments, the adaptive interval's
    sums and, as the schedules fall, the accumulated gradient are live), loaded into a fresh
    engine: the next 5 steps are bitwise the uninterrupted run's. Zeroing the loaded ZenFlow
    tensors (accumulated gradient, selective moments) changes them: the comparison sees them."""
    skip_repeat_at_three(groups.world_size, stage)
    rank, world = groups.rank, groups.world_size
    epoch_steps = RESUME[case][1]
    batches = global_batches(12, MICRO * world)
    engine = init_engine(make_model(), resume_config(stage, case), **loader_data(epoch_steps, world))
    train_engine(engine, batches[:7], rank, world)
    engine.save_checkpoint(shared_dir, tag="s7")
    _, cont = train_engine(engine, batches[7:], rank, world)

    resumed = init_engine(make_model(seed=5), resume_config(stage, case), **loader_data(epoch_steps, world))
    resumed.load_checkpoint(shared_dir, tag="s7")
    assert resumed.optimizer.optimizer.steps == 7
    _, again = train_engine(resumed, batches[7:], rank, world)
    for k in range(len(cont)):
        assert_params_close(again[k], cont[k], 0.0, f"stage {stage}, {case}, step {k + 8} after resume")

    perturbed = init_engine(make_model(seed=5), resume_config(stage, case), **loader_data(epoch_steps, world))
    perturbed.load_checkpoint(shared_dir, tag="s7")
    for piece in perturbed.optimizer.optimizer._pieces:
        for t in (piece.acc, piece.exp_avg, piece.exp_avg_sq):
            t.zero_()
    _, lost = train_engine(perturbed, batches[7:], rank, world)
    assert any(not torch.equal(a, b) for a, b in zip(lost[-1], cont[-1])), "ZenFlow's loaded state mattered"


def test_checkpoint_across_runs(groups, shared_dir) -> None:
    """What resumes and what is refused: another world size (refused by name), a checkpoint
    without ZenFlow's state (refused, or ZenFlow afresh with load_optimizer_states=False), and a
    ZenFlow checkpoint in a run without zenflow (its ZenFlow state dropped)."""
    rank, world = groups.rank, groups.world_size
    batches = global_batches(3, MICRO * world)
    zen = zen_config(2, RESUME["intervals"][0])
    engine = init_engine(make_model(), zen)
    train_engine(engine, batches, rank, world)
    step = engine.optimizer.optimizer
    saved = step.state_dict()
    for entry in saved["state"].values():
        entry["zenflow"] = {**entry["zenflow"], "world_size": world + 1}
    refused = rf"saved by {world + 1} data-parallel ranks on {world}: not implemented"
    with pytest.raises(NotSupportedError, match=refused):
        step.load_state_dict(saved)
    engine.save_checkpoint(shared_dir, tag="zen")

    plain_cfg = make_config(zero_optimization={"stage": 2, "reduce_bucket_size": 500,
                                               "offload_optimizer": {"device": "cpu"}})
    plain = init_engine(make_model(), plain_cfg)
    plain.load_checkpoint(shared_dir, tag="zen")  # ZenFlow's state dropped; plain offload continues
    assert not any(k.startswith("zenflow") for s in plain.optimizer.state.values() for k in s)
    train_engine(plain, batches, rank, world)
    plain.save_checkpoint(shared_dir, tag="plain")

    fresh = init_engine(make_model(seed=5), zen)
    before = gathered_snapshot(fresh.module)
    with pytest.raises(NotSupportedError, match=r"holds no ZenFlow state for \d+ of this rank's fragments"):
        fresh.load_checkpoint(shared_dir, tag="plain")
    assert_params_close(gathered_snapshot(fresh.module), before, 0.0, "a refused load changes nothing")
    fresh = init_engine(make_model(seed=5), zen)
    fresh.load_checkpoint(shared_dir, tag="plain", load_optimizer_states=False)
    assert fresh.optimizer.optimizer.steps == 0
    train_engine(fresh, batches, rank, world)
