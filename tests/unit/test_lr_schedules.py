"""DeepSpeed lr schedules against closed-form curves written independently here."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch

from zeroshard.errors import ConfigError
from zeroshard.optim.lr_schedules import (
    SCHEDULERS,
    LRRangeTest,
    LRSchedule,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    WarmupType,
    build_scheduler,
)


def make_opt(kind: str = "adamw", lrs: tuple[float, ...] = (0.5,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lrs[0], momentum=0.5)
    return torch.optim.AdamW(groups, lr=lrs[0], betas=(0.9, 0.999))


def lrs_of(opt: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in opt.param_groups]


def run_curve(sched: LRSchedule, opt: torch.optim.Optimizer, n: int) -> list[list[float]]:
    """lrs after construction, then after each of n steps."""
    curve = [lrs_of(opt)]
    for _ in range(n):
        sched.step()
        curve.append(lrs_of(opt))
    return curve


def check_curve(curve: list[list[float]], expected: Callable[[int], list[float]]) -> None:
    """curve[k + 1] is the lr after step k (last_batch_iteration == k); curve[0] is it == -1."""
    for k, got in enumerate(curve):
        want = expected(k - 1)
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), f"last_batch_iteration={k - 1}"


# --- WarmupLR -------------------------------------------------------------------------------


@pytest.mark.parametrize("lo,hi,warm", [(0.0, 1e-3, 100), (1e-4, 2e-3, 37), (1e-5, 1e-2, 1)])
def test_warmup_lr_log(lo: float, hi: float, warm: int) -> None:
    opt = make_opt()
    sched = WarmupLR(opt, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=warm)
    w = max(2, warm)  # DeepSpeed clamps the warmup to 2 steps

    def expected(it: int) -> list[float]:
        if it < 0:
            return [lo]
        return [lo + (hi - lo) * math.log(it + 1) / math.log(w) if it < w else hi]

    check_curve(run_curve(sched, opt, 300), expected)
    assert sched.get_last_lr() == pytest.approx([hi])


def test_warmup_lr_linear_edges() -> None:
    opt = make_opt()
    sched = WarmupLR(opt, warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=10, warmup_type="linear")
    curve = run_curve(sched, opt, 200)
    assert curve[0] == [0.1]  # construction: the minimum
    assert curve[1] == [0.1]  # after step 0: still the minimum (0 / 10)
    assert curve[10] == pytest.approx([0.1 + 1.0 * 9 / 10])  # last warmup step
    assert curve[11] == [1.1]  # it == warmup_num_steps: the maximum, held
    check_curve(curve, lambda it: [0.1 if it < 0 else 0.1 + min(it, 10) / 10])


def test_warmup_lr_per_group_lists_and_constant() -> None:
    opt = make_opt(lrs=(1.0, 2.0, 3.0))
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.5, 0.7], warmup_max_lr=[1.0, 0.5, 0.9], warmup_num_steps=50)
    curve = run_curve(sched, opt, 120)

    def frac(it: int) -> float:
        return 0.0 if it < 0 else min(1.0, math.log(it + 1) / math.log(50))

    check_curve(curve, lambda it: [frac(it), 0.5, 0.7 + 0.2 * frac(it)])
    assert all(row[1] == 0.5 for row in curve)  # min == max: constant


def test_warmup_lr_default_max_is_the_optimizer_lr() -> None:
    opt = make_opt(lrs=(0.25, 0.75))
    sched = WarmupLR(opt, warmup_num_steps=4, warmup_type="linear")
    curve = run_curve(sched, opt, 6)
    assert curve[0] == [0.0, 0.0]
    assert curve[-1] == [0.25, 0.75]


def test_warmup_lr_errors() -> None:
    with pytest.raises(ConfigError, match="warmup_type.*Did you mean \"linear\""):
        WarmupLR(make_opt(), warmup_type="linaer")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="warmup_num_steps"):
        WarmupLR(make_opt(), warmup_num_steps=0)
    with pytest.raises(ConfigError, match="warmup_max_lr.*2 values.*3"):
        WarmupLR(make_opt(lrs=(1.0, 1.0, 1.0)), warmup_max_lr=[1.0, 2.0])


# --- WarmupDecayLR --------------------------------------------------------------------------


@pytest.mark.parametrize("warm_type", ["log", "linear"])
@pytest.mark.parametrize("lo,hi,warm,total", [(0.0, 1e-3, 20, 200), (1e-4, 1e-3, 1, 50), (0.0, 0.1, 30, 30)])
def test_warmup_decay_lr(warm_type: WarmupType, lo: float, hi: float, warm: int, total: int) -> None:
    opt = make_opt()
    sched = WarmupDecayLR(opt, total_num_steps=total, warmup_min_lr=lo, warmup_max_lr=hi,
                          warmup_num_steps=warm, warmup_type=warm_type)
    w = max(2, warm)

    def expected(it: int) -> list[float]:
        if it < 0:
            return [lo]
        if it < w:
            g = math.log(it + 1) / math.log(w) if warm_type == "log" else it / w
        else:
            g = max(0.0, (total - it) / max(1, total - w))
        return [lo + (hi - lo) * g]

    curve = run_curve(sched, opt, total + 40)
    check_curve(curve, expected)
    if total > w:
        assert curve[w + 1] == pytest.approx([hi])  # end of warmup: the maximum
    assert curve[total + 1] == pytest.approx([lo])  # at total_num_steps: back to the minimum
    assert curve[-1] == pytest.approx([lo])  # and it stays there


def test_warmup_decay_default_max_lr() -> None:
    opt = make_opt()
    sched = WarmupDecayLR(opt, total_num_steps=10, warmup_num_steps=2)
    sched.step(1)
    sched.step(2)
    assert lrs_of(opt) == pytest.approx([0.001])


# --- WarmupCosineLR -------------------------------------------------------------------------


@pytest.mark.parametrize("warm_type", ["log", "linear"])
@pytest.mark.parametrize("r0,warm,cmin,total", [(0.0, 20, 1e-4, 200), (0.1, 5, 0.05, 60), (0.3, 1, 0.0, 10)])
def test_warmup_cosine_lr(warm_type: WarmupType, r0: float, warm: int, cmin: float, total: int) -> None:
    base = [0.5, 0.2]
    opt = make_opt(lrs=tuple(base))
    sched = WarmupCosineLR(opt, total_num_steps=total, warmup_min_ratio=r0, warmup_num_steps=warm,
                           cos_min_ratio=cmin, warmup_type=warm_type)
    w = max(2, warm)

    def ratio(it: int) -> float:
        if it < 0:
            return 0.0  # DeepSpeed: lr 0 until the first step, whatever warmup_min_ratio is
        if it < w:
            frac = math.log(it + 1) / math.log(w) if warm_type == "log" else it / w
            return r0 + (1 - r0) * frac
        progress = min(1.0, (it - w + 1) / max(1, total - w))
        return cmin + (1 - cmin) * 0.5 * (1 + math.cos(math.pi * progress))

    curve = run_curve(sched, opt, total + 50)
    check_curve(curve, lambda it: [b * ratio(it) for b in base])
    assert curve[0] == [0.0, 0.0]
    assert curve[1] == pytest.approx([b * r0 for b in base])  # step 0: warmup_min_ratio
    assert curve[-1] == pytest.approx([b * cmin for b in base])  # past total: floor, no rebound


# --- OneCycle -------------------------------------------------------------------------------


def one_cycle_scale(b: int, up: int, down: int) -> float:
    """Triangle on batch index b = last_batch_iteration + 1 inside the cycle."""
    return b / up if b <= up else (up + down - b) / down


@pytest.mark.parametrize("up,down", [(10, None), (7, 13), (25, 5)])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_one_cycle_lr_and_momentum(up: int, down: int | None, kind: str) -> None:
    lo, hi, mlo, mhi = 0.01, 0.1, 0.8, 0.95
    dn = up if down is None else down
    total = up + dn
    decay_step, decay_lr, decay_mom = 4, 0.5, 0.01
    opt = make_opt(kind)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched = OneCycle(opt, cycle_min_lr=lo, cycle_max_lr=hi, cycle_first_step_size=up,
                         cycle_second_step_size=down, decay_step_size=decay_step, decay_lr_rate=decay_lr,
                         cycle_min_mom=mlo, cycle_max_mom=mhi, decay_mom_rate=decay_mom)
    assert [str(w.message).startswith("OneCycle: cycle_momentum disabled") for w in caught] == (
        [True] if kind == "sgd" else [])

    def mom() -> float:
        group = opt.param_groups[0]
        if kind == "adamw":
            assert group["betas"][1] == 0.99  # DeepSpeed's OneCycle pins beta2 at 0.99 (not 0.999)
            return float(group["betas"][0])
        return float(group["momentum"])

    if kind == "sgd":  # DeepSpeed cycles betas only: SGD keeps its momentum
        assert lrs_of(opt) == [lo] and mom() == 0.5 and not sched.cycle_momentum
        sched.step()
        assert mom() == 0.5
        return
    assert lrs_of(opt) == [lo] and mom() == mlo  # construction: the "initial" (minimum) values
    for it in range(3 * total):
        sched.step()
        if it < total:
            s = one_cycle_scale(it + 1, up, dn)
            want_lr, want_mom = lo + (hi - lo) * s, mhi - (mhi - mlo) * s
        else:
            d = (it - total + 1) / decay_step
            want_lr, want_mom = lo / (1 + decay_lr * d), mhi * (1 + decay_mom * d)
        assert lrs_of(opt) == pytest.approx([want_lr], rel=1e-12), it
        assert mom() == pytest.approx(want_mom, rel=1e-12), it
    assert sched.get_last_lr() == lrs_of(opt)


def test_one_cycle_peak_and_no_decay_by_default() -> None:
    opt = make_opt()
    sched = OneCycle(opt, 0.001, 0.01, cycle_first_step_size=5)
    curve = run_curve(sched, opt, 30)
    assert curve[5] == pytest.approx([0.01])  # last_batch_iteration 4: peak
    assert all(row == pytest.approx([0.001]) for row in curve[10:])  # decay off: stays at the min
    assert opt.param_groups[0]["betas"][0] == pytest.approx(0.9)  # and momentum at the max


def test_one_cycle_stairs() -> None:
    opt = make_opt()
    sched = OneCycle(opt, 0.0, 1.0, cycle_first_step_size=8, cycle_second_step_size=4,
                     cycle_first_stair_count=4, cycle_second_stair_count=2, cycle_momentum=False)
    for it in range(12):
        sched.step()
        b = it + 1
        want = math.floor(b * 4 / 8) / 4 if b <= 8 else math.floor((12 - b) * 2 / 4) / 2
        assert lrs_of(opt) == pytest.approx([want]), it


def test_one_cycle_momentum_needs_a_momentum_key() -> None:
    opt = torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.warns(UserWarning, match="cycle_momentum disabled"):
        sched = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=2)
    sched.step()
    assert sched.get_mom() is None


# --- LRRangeTest ----------------------------------------------------------------------------


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase: bool) -> None:
    opt = make_opt(lrs=(1.0, 1.0))
    sched = LRRangeTest(opt, lr_range_test_min_lr=[1e-3, 2e-3], lr_range_test_step_size=7,
                        lr_range_test_step_rate=0.5, lr_range_test_staircase=staircase)

    def expected(it: int) -> list[float]:
        n = (it + 1) // 7 if staircase else (it + 1) / 7
        return [m * (1 + 0.5 * n) for m in (1e-3, 2e-3)]

    check_curve(run_curve(sched, opt, 100), expected)


# --- resume, explicit steps, tensor lrs -------------------------------------------------------

FACTORIES: dict[str, Callable[[torch.optim.Optimizer], LRSchedule]] = {
    "WarmupLR": lambda o: WarmupLR(o, warmup_max_lr=0.1, warmup_num_steps=30, warmup_type="linear"),
    "WarmupDecayLR": lambda o: WarmupDecayLR(o, total_num_steps=80, warmup_max_lr=0.1, warmup_num_steps=20),
    "WarmupCosineLR": lambda o: WarmupCosineLR(o, total_num_steps=80, warmup_num_steps=20, warmup_min_ratio=0.1),
    "OneCycle": lambda o: OneCycle(o, 0.01, 0.1, cycle_first_step_size=20, decay_step_size=5, decay_lr_rate=0.1,
                                   decay_mom_rate=0.01),
    "LRRangeTest": lambda o: LRRangeTest(o, lr_range_test_step_size=10),
}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_state_dict_resume_equals_uninterrupted(name: str) -> None:
    ref_opt = make_opt()
    ref = FACTORIES[name](ref_opt)
    ref_curve = [(lrs_of(ref_opt), ref_opt.param_groups[0]["betas"])]
    for _ in range(100):
        ref.step()
        ref_curve.append((lrs_of(ref_opt), ref_opt.param_groups[0]["betas"]))

    opt = make_opt()
    sched = FACTORIES[name](opt)
    for _ in range(37):
        sched.step()
    saved = sched.state_dict()
    assert saved == {"last_batch_iteration": 36}

    opt2 = make_opt()  # a fresh run: new optimizer, new schedule, then the checkpoint
    resumed = FACTORIES[name](opt2)
    resumed.load_state_dict(saved)
    assert (lrs_of(opt2), opt2.param_groups[0]["betas"]) == ref_curve[37]  # lr restored at once
    for k in range(38, 101):
        resumed.step()
        assert (lrs_of(opt2), opt2.param_groups[0]["betas"]) == ref_curve[k]


def test_explicit_step_and_resume_via_constructor() -> None:
    opt = make_opt()
    sched = WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    sched.step(5)
    assert lrs_of(opt) == pytest.approx([0.5]) and sched.last_batch_iteration == 5
    opt2 = make_opt()
    WarmupLR(opt2, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear", last_batch_iteration=5)
    assert lrs_of(opt2) == pytest.approx([0.5])


def test_tensor_lr_is_updated_in_place() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.01))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupLR(opt, warmup_max_lr=0.02, warmup_num_steps=2, warmup_type="linear")
    sched.step(2)  # it == warmup_num_steps: the maximum
    assert opt.param_groups[0]["lr"] is lr_tensor and float(lr_tensor) == pytest.approx(0.02)


# --- registry and factory ---------------------------------------------------------------------


def test_registry_and_build() -> None:
    assert set(SCHEDULERS) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"}
    opt = make_opt()
    sched = build_scheduler("WarmupDecayLR", opt, {"total_num_steps": 100, "warmup_num_steps": 10})
    assert isinstance(sched, WarmupDecayLR) and sched.total_num_steps == 100
    step_lr = build_scheduler("StepLR", make_opt(), {"step_size": 3})
    assert isinstance(step_lr, torch.optim.lr_scheduler.StepLR)


def test_build_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match='scheduler.type.*Did you mean "WarmupLR"'):
        build_scheduler("WarmupLr", make_opt(), {})
    with pytest.raises(ConfigError, match='scheduler.params.warmup_num_step:.*"warmup_num_steps"'):
        build_scheduler("WarmupLR", make_opt(), {"warmup_num_step": 10})
    with pytest.raises(ConfigError, match="scheduler.params.total_num_steps: required"):
        build_scheduler("WarmupCosineLR", make_opt(), {})
    with pytest.raises(ConfigError, match="scheduler.params.warmup_type"):
        build_scheduler("WarmupLR", make_opt(), {"warmup_type": "cosine"})


# --- OneCycle: DeepSpeed's per-group lists and a zero second half ----------------------------


def test_one_cycle_per_group_momentum_lists() -> None:
    """cycle_min_mom / cycle_max_mom may be one value per group (as cycle_min_lr); each group's
    betas[0] follows its own pair and get_mom() gives DeepSpeed's per-group (momentum, 0.99)."""
    opt = torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
                            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2}], betas=(0.9, 0.999))
    sched = OneCycle(opt, cycle_min_lr=[0.001, 0.002], cycle_max_lr=[0.01, 0.02], cycle_min_mom=[0.8, 0.85],
                     cycle_max_mom=[0.9, 0.95], cycle_first_step_size=5, cycle_second_step_size=5)
    assert [g["betas"] for g in opt.param_groups] == [(0.8, 0.99), (0.85, 0.99)]
    sched.step(4)  # the peak: lr at max, momentum at min
    assert lrs_of(opt) == pytest.approx([0.01, 0.02])
    assert [b[0] for b in sched.get_mom()] == pytest.approx([0.8, 0.85])
    sched.step(9)  # back at the bottom: momentum at each group's max
    assert [g["betas"][0] for g in opt.param_groups] == pytest.approx([0.9, 0.95])
    with pytest.raises(ConfigError, match="cycle_min_mom: got 3 values"):
        OneCycle(opt, 0.001, 0.01, cycle_min_mom=[0.8, 0.85, 0.9], cycle_first_step_size=5)


def test_one_cycle_zero_second_half_rises_over_the_whole_cycle() -> None:
    opt = make_opt(lrs=(0.1,))
    sched = OneCycle(opt, 0.001, 0.1, cycle_first_step_size=100, cycle_second_step_size=0, cycle_momentum=False)
    assert sched.step_ratio == 1.0 and lrs_of(opt) == pytest.approx([0.001])
    for _ in range(3):
        sched.step()
    assert lrs_of(opt)[0] == pytest.approx(0.001 + (0.1 - 0.001) * 3 / 100)
    with pytest.raises(ConfigError, match="second half >= 0"):
        OneCycle(opt, 0.001, 0.1, cycle_first_step_size=100, cycle_second_step_size=-1)
    with pytest.raises(ConfigError, match="expected a positive first half"):
        OneCycle(opt, 0.001, 0.1, cycle_first_step_size=0, cycle_second_step_size=0)
