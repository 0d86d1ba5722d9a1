"""ZenFlow with `overlap_step: true` follows DeepSpeed 0.19.8's overlapped rule (Note: [zenflow
overlap] in zeroshard/zero/offload/zenflow_overlap.py), checked against `overlap_reference` below.

The reference is plain torch over whole parameters, fp32 (bf16 where a case says so): each rank's
gradient computed on its own micro-batch and summed in rank order, averaged and divided by
update_interval; the top-k columns by the L1 norm over dim 0 (torch.topk), every 1-D parameter
whole; an fp32 accumulator; at the rule's CPU steps the previous CPU step's master values cast
into the model except the selected columns, then AdamW (torch's single-tensor arithmetic, step
count k + 1) on the fp32 master with one of two moment sets, its result kept for the next CPU
step (cast at once during the warm-up); torch's AdamW on the selected columns every step after
the warm-up. Run at world sizes 1, 2 and 3, ZeRO stages 1 and 2: bitwise equal at each (gloo sums
three ranks' gradients in the reference's order on this CPU).
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
LR, WD, CLIP = 1e-2, 0.01, 0.3
CASES: dict[str, dict[str, Any]] = {
    # W = 0: selections at 0, 4, 8; CPU steps at every odd k, each cast into the model two steps later
    "intervals": {"topk_ratio": 0.25, "select_interval": 4, "update_interval": 2},
    # CPU steps at 0-2 (synchronous), 4, 6, 8, 9, 10 (8 and 9 share moment set 0); reselections at
    # 5 and 10 with the step of 4 (and 9) in flight
    "warm-up": {"topk_ratio": 0.25, "select_interval": 5, "update_interval": 2, "full_warm_up_rounds": 3},
    "auto update": {"topk_ratio": 0.1, "select_interval": 5, "update_interval": "auto"},
    "clips": {"topk_ratio": 0.25, "select_interval": 4, "update_interval": 2, "clip": CLIP},
    "clips, warm-up": {"topk_ratio": 0.25, "select_interval": 5, "update_interval": 2, "full_warm_up_rounds": 3,
                       "clip": CLIP},
    # the configured Adam with weight decay: the overlapped CPU step is AdamW all the same (as DeepSpeed's)
    "Adam": {"topk_ratio": 0.25, "select_interval": 4, "update_interval": 2, "optimizer": "Adam"},
    "bf16": {"topk_ratio": 0.25, "select_interval": 4, "update_interval": 2, "bf16": True},
}


def case_config(stage: int, case: str) -> dict[str, Any]:
    spec = dict(CASES[case])
    clip, optimizer, bf16 = spec.pop("clip", 0.0), spec.pop("optimizer", "AdamW"), spec.pop("bf16", False)
    cfg = make_config(zero_optimization={"stage": stage, "reduce_bucket_size": 500,
                                         "offload_optimizer": {"device": "cpu"},
                                         "zenflow": {"select_strategy": "step", "overlap_step": True, **spec}})
    cfg["gradient_clipping"] = clip
    cfg["optimizer"] = {"type": optimizer, "params": {"lr": LR, "weight_decay": WD}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def reference_for(case: str, model: nn.Module, batches: list[tuple[Tensor, Tensor]], world: int,
                  **perturb: Any) -> list[list[Tensor]]:
    spec = CASES[case]
    update = spec["update_interval"]
    return overlap_reference(model, batches, world, spec["topk_ratio"], spec["select_interval"],
                             None if update == "auto" else update, spec.get("full_warm_up_rounds", 0),
                             clip=spec.get("clip", 0.0), bf16=spec.get("bf16", False), **perturb)


def overlap_reference(model: nn.Module, batches: list[tuple[Tensor, Tensor]], world: int, topk: float, select: int,
                      update: int | None, warmup: int, clip: float = 0.0, bf16: bool = False,
                      auto_ratio: float = 0.99, lag: int = 1, one_set: bool = False) -> list[list[Tensor]]:
    """The overlapped rule written out; the weights after each step. `update` None: "auto" (the
    gradient not divided, the CPU step on the accumulated mean, a step after one whose sums call
    for it). Perturbations: `lag` 0 casts each CPU step at once; `one_set` keeps one moment set."""
    model = copy.deepcopy(model).to(torch.bfloat16) if bf16 else copy.deepcopy(model)
    params = list(model.parameters())
    master = [p.detach().float().clone() for p in params]
    cpu_moments = [[torch.zeros_like(m) for m in master] for _ in range(4)]  # exp_avg 0, 1; exp_avg_sq 0, 1
    acc = [torch.zeros_like(m) for m in master]
    cols: list[Tensor | None] = [None] * len(params)
    selected = False
    exp_avg: list[Tensor] = []
    exp_avg_sq: list[Tensor] = []
    sel_step = [torch.zeros(()) for _ in params]
    pending: list[Tensor] | None = None
    accumulated, interval, due_next = 0, 0, False
    avg_critic = [torch.zeros((), dtype=torch.float64) for _ in params]
    non_critic = [torch.zeros((), dtype=torch.float64) for _ in params]

    def publish(values: list[Tensor]) -> None:
        for i, (p, v) in enumerate(zip(params, values)):
            kept = _selected(p, cols[i]).clone() if selected else None
            p.copy_(v.view_as(p))
            if kept is not None:
                _set_selected(p, cols[i], kept)

    weights = []
    for k, batch in enumerate(batches):
        total: list[Tensor] | None = None
        for r in range(world):
            x, y = rank_micro_batches(batch, r, world, MICRO, 1)[0]
            grads = [g.float() for g in torch.autograd.grad(model(x, y), params)]
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        assert total is not None
        grads = [(t * (1.0 / world) if world != 1 else t) / (update or 1) for t in total]
        step_norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in total)) * (1.0 / world)
        with torch.no_grad():
            fire = False
            if update is None:
                fire, due_next = due_next, False
                if fire:
                    interval, non_critic = 0, [torch.zeros((), dtype=torch.float64) for _ in params]
                interval += 1
            if k >= warmup and (k == warmup or (select > 0 and k % select == 0)):
                if k > 0:
                    for m, p in zip(master, params):
                        m.copy_(p)
                for i, (p, g) in enumerate(zip(params, grads)):
                    if p.dim() == 2:
                        cols[i] = torch.topk(g.abs().sum(dim=0), max(1, int(p.shape[1] * topk))).indices.sort().values
                selected = True
                exp_avg = [torch.zeros_like(_selected(p, c)) for p, c in zip(params, cols)]
                exp_avg_sq = [torch.zeros_like(_selected(p, c)) for p, c in zip(params, cols)]
            if update is None and k >= warmup:
                calls, two_d = 0, 0
                for i, (p, g) in enumerate(zip(params, grads)):
                    if p.dim() == 2:
                        whole, critic = g.double().abs().sum(), _selected(g, cols[i]).double().abs().sum()
                        avg_critic[i] = (avg_critic[i] * (interval - 1) + critic) / interval / (topk * 10)
                        non_critic[i] = non_critic[i] + (whole - critic) / ((1 - topk) * 10)
                        calls, two_d = calls + int(non_critic[i] >= avg_critic[i]), two_d + 1
                due_next = two_d > 0 and calls >= int(auto_ratio * two_d)
            for a, g in zip(acc, grads):
                a.add_(g)
            accumulated += 1
            due = fire if update is None else (k + 1 - warmup) % update == 0
            if k + 1 <= warmup or due or (select > 0 and (k + 1) % select == 0):
                if pending is not None:
                    publish(pending)
                    pending = None
                given = [a / accumulated if update is None and accumulated != 1 else a.clone() for a in acc]
                coef = _clip_factor(clip, math.sqrt(sum(float(g.double().pow(2).sum()) for g in given)))
                s = 0 if one_set else (k & 1 if k < warmup else ((k + 1) & 1 if update is None else (k // update) & 1))
                for i, (m, g) in enumerate(zip(master, given)):
                    adamw([m], [g * coef if coef != 1.0 else g], [cpu_moments[s][i]], [cpu_moments[2 + s][i]], [],
                          [torch.tensor(float(k))], foreach=False, amsgrad=False, beta1=0.9, beta2=0.999, lr=LR,
                          weight_decay=WD, eps=1e-8, maximize=False)
                for a in acc:
                    a.zero_()
                accumulated = 0
                if k < warmup or lag == 0:
                    publish([m.clone() for m in master])
                else:
                    pending = [m.clone() for m in master]
            if k >= warmup:  # the selective AdamW, clipped by the step's norm (Note: [zenflow clip])
                sel_coef = _clip_factor(clip, step_norm)
                for i, (p, g) in enumerate(zip(params, grads)):
                    values = _selected(p, cols[i]).clone()
                    sel_grad = _selected(g, cols[i])
                    sel_grad = sel_grad * sel_coef if sel_coef != 1.0 else sel_grad
                    adamw([values], [sel_grad.to(values.dtype)], [exp_avg[i]], [exp_avg_sq[i]], [], [sel_step[i]],
                          foreach=False, amsgrad=False, beta1=0.9, beta2=0.999, lr=LR, weight_decay=WD, eps=1e-8,
                          maximize=False)
                    _set_selected(p, cols[i], values)
        weights.append([p.detach().float().clone() for p in params])
    return weights


def _clip_factor(clip: float, norm: float) -> float:
    return min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0


def _selected(t: Tensor, columns: Tensor | None) -> Tensor:
    return t[:, columns] if t.dim() == 2 else t


def _set_selected(t: Tensor, columns: Tensor | None, values: Tensor) -> None:
    if t.dim() == 2:
        t[:, columns] = values.to(t.dtype)
    else:
        t.copy_(values)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overlap_matches_reference(groups, stage: int, case: str) -> None:
    skip_repeat_at_three(groups.world_size, stage)
    rank, world = groups.rank, groups.world_size
    model = make_model()
    batches = global_batches(STEPS, MICRO * world)
    engine = init_engine(copy.deepcopy(model), case_config(stage, case))
    assert isinstance(engine.optimizer.optimizer, ZenFlowStep) and engine.optimizer.optimizer._overlap is not None
    _, got = train_engine(engine, batches, rank, world)
    want = reference_for(case, model, batches, world)
    for k in range(STEPS):
        assert_params_close(got[k], want[k], 0.0, f"stage {stage}, {case}, weights after step {k + 1}")


@pytest.mark.parametrize("case", ["intervals", "warm-up", "auto update"])
def test_overlap_rule_can_fail(groups, case: str) -> None:
    """The comparison above sees the lag and the two moment sets: casting each CPU step at once,
    or keeping one moment set, gives other weights."""
    world = groups.world_size
    model = make_model()
    batches = global_batches(STEPS, MICRO * world)
    rule = reference_for(case, model, batches, world)
    for perturb in ({"lag": 0}, {"one_set": True}):
        other = reference_for(case, model, batches, world, **perturb)
        assert any(not torch.equal(a, b) for a, b in zip(rule[-1], other[-1])), perturb


RESUME = ["intervals", "warm-up", "clips"]


@pytest.mark.parametrize("case", RESUME)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overlap_checkpoint_resumes_exactly(groups, shared_dir, stage: int, case: str) -> None:
    """Saved after 7 steps ("intervals": the CPU step of step 5 done, not yet in the model;
    "warm-up": the one of step 6 in flight, drained by the save), loaded into a fresh engine: the
    next 5 steps are bitwise the uninterrupted run's, and the reference's. Dropping the loaded
    pending result, or zeroing the loaded moment sets, changes them."""
    skip_repeat_at_three(groups.world_size, stage)
    rank, world = groups.rank, groups.world_size
    batches = global_batches(12, MICRO * world)
    model = make_model()
    engine = init_engine(copy.deepcopy(model), case_config(stage, case))
    train_engine(engine, batches[:7], rank, world)
    engine.save_checkpoint(shared_dir, tag="o7")
    _, cont = train_engine(engine, batches[7:], rank, world)
    want = reference_for(case, model, batches, world)
    for k in range(len(cont)):
        assert_params_close(cont[k], want[k + 7], 0.0, f"{case}, uninterrupted step {k + 8}")

    resumed = init_engine(make_model(seed=5), case_config(stage, case))
    resumed.load_checkpoint(shared_dir, tag="o7")
    assert resumed.optimizer.optimizer.steps == 7
    _, again = train_engine(resumed, batches[7:], rank, world)
    for k in range(len(cont)):
        assert_params_close(again[k], cont[k], 0.0, f"stage {stage}, {case}, step {k + 8} after resume")

    for lose in ("pending", "moments"):
        perturbed = init_engine(make_model(seed=5), case_config(stage, case))
        perturbed.load_checkpoint(shared_dir, tag="o7")
        overlap = perturbed.optimizer.optimizer._overlap
        if lose == "pending":
            assert overlap._pending is not None  # both schedules have a CPU step at 5 or 6
            overlap._pending = None
        else:
            for moments in overlap._moments:
                for t in moments:
                    t.zero_()
        _, lost = train_engine(perturbed, batches[7:], rank, world)
        assert any(not torch.equal(a, b) for a, b in zip(lost[-1], cont[-1])), f"the loaded {lose} mattered"


def test_overlap_checkpoint_not_mixed(groups, shared_dir) -> None:
    """A checkpoint saved with overlap_step true resumes only with it (and the reverse)."""
    rank, world = groups.rank, groups.world_size
    batches = global_batches(3, MICRO * world)
    engine = init_engine(make_model(), case_config(2, "intervals"))
    train_engine(engine, batches, rank, world)
    engine.save_checkpoint(shared_dir, tag="ov")
    sequential = case_config(2, "intervals")
    sequential["zero_optimization"]["zenflow"]["overlap_step"] = False
    other = init_engine(make_model(seed=5), sequential)
    with pytest.raises(NotSupportedError, match="saved with overlap_step true, this run has false"):
        other.load_checkpoint(shared_dir, tag="ov")
    other.load_checkpoint(shared_dir, tag="ov", load_optimizer_states=False)
    train_engine(other, batches, rank, world)


def test_overlap_config() -> None:
    def load(zenflow: dict[str, Any]) -> Any:
        return load_config({"train_batch_size": 2, "gradient_clipping": 0.0, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": zenflow}}, dp_world_size=1)

    step = {"select_strategy": "step", "select_interval": 4, "update_interval": 2}
    assert load({**step, "overlap_step": True}).zero_optimization.zenflow.overlap_step
    with pytest.raises(ConfigError, match="overlap_step"):
        load({**step, "overlap_step": "yes"})
    with pytest.raises(ConfigError, match="pt_reserved_cores_perc"):
        load({**step, "overlap_step": True, "pt_reserved_cores_perc": 1.5})


def test_overlap_runs_behind(groups) -> None:
    """After a CPU-step boundary past the warm-up, that CPU step is left running (or done) on the
    worker thread, not waited for by `step()`; the model's values do not hold it yet."""
    rank, world = groups.rank, groups.world_size
    batches = global_batches(2, MICRO * world)
    engine = init_engine(make_model(), case_config(2, "intervals"))
    train_engine(engine, batches[:1], rank, world)
    overlap = engine.optimizer.optimizer._overlap
    assert overlap._future is None and overlap._pending is None  # step 0 is no CPU step
    train_engine(engine, batches[1:], rank, world)  # step 1 ends with one
    assert overlap._future is not None and overlap._pending is None
    overlap.wait()
    assert overlap._pending is not None and overlap._future is None
