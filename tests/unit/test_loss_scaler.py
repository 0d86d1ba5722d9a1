"""Loss scalers on injected overflow sequences, with hand-worked expected scales."""

from __future__ import annotations

import random
from typing import Any

import pytest

from zeroshard.errors import ConfigError
from zeroshard.runtime.loss_scaler import (
    DynamicLossScaler,
    LossScaleError,
    LossScaler,
    StaticLossScaler,
    build_loss_scaler,
)

T, F = True, False  # overflow / clean step


def scales_after(scaler: LossScaler, overflows: list[bool]) -> list[float]:
    out = []
    for overflow in overflows:
        scaler.update(overflow)
        out.append(scaler.loss_scale)
    return out


def test_overflow_lowers_at_once_without_hysteresis() -> None:
    scaler = DynamicLossScaler(init_scale=1024.0, hysteresis=1, scale_window=100)
    assert scales_after(scaler, [T, F, T, T]) == [512.0, 512.0, 256.0, 128.0]


def test_hysteresis_needs_two_overflows_before_the_first_lowering() -> None:
    scaler = DynamicLossScaler(init_scale=1024.0, hysteresis=2, scale_window=100)
    # 1st overflow only spends the countdown; the 2nd lowers; the countdown stays spent, so the
    # 3rd lowers again even after clean steps in between.
    assert scales_after(scaler, [T, F, T, F, F, T]) == [1024.0, 1024.0, 512.0, 512.0, 512.0, 256.0]
    deeper = DynamicLossScaler(init_scale=64.0, hysteresis=3, scale_window=100)
    assert scales_after(deeper, [T, T, T, T]) == [64.0, 64.0, 32.0, 16.0]


def test_raise_after_window_counted_from_start() -> None:
    scaler = DynamicLossScaler(init_scale=16.0, scale_window=2, hysteresis=1)
    # update k (0-based) raises when k - (-1) - 1 = k is a positive multiple of the window.
    assert scales_after(scaler, [F] * 7) == [16.0, 16.0, 32.0, 32.0, 64.0, 64.0, 128.0]


def test_raise_after_window_counted_from_last_overflow() -> None:
    scaler = DynamicLossScaler(init_scale=16.0, scale_window=3, hysteresis=1)
    # overflow at update 0; clean updates 1, 2, 3 have 0, 1, 2 clean steps before them; update 4
    # has 3 -> raise; the next raise 3 updates later.
    assert scales_after(scaler, [T, F, F, F, F, F, F, F]) == [8.0, 8.0, 8.0, 8.0, 16.0, 16.0, 16.0, 32.0]
    # An overflow in the middle restarts the count.
    again = DynamicLossScaler(init_scale=16.0, scale_window=3, hysteresis=1)
    assert scales_after(again, [F, F, T, F, F, F, F]) == [16.0, 16.0, 8.0, 8.0, 8.0, 8.0, 16.0]


def test_raise_refills_hysteresis() -> None:
    scaler = DynamicLossScaler(init_scale=16.0, scale_window=2, hysteresis=2)
    # T spends the countdown (2 -> 1); the raise at update 3 refills it, so the next T is absorbed.
    assert scales_after(scaler, [T, F, F, F, T]) == [16.0, 16.0, 16.0, 32.0, 32.0]
    assert scaler.cur_hysteresis == 1
    no_raise = DynamicLossScaler(init_scale=16.0, scale_window=100, hysteresis=2)
    assert scales_after(no_raise, [T, F, F, F, T]) == [16.0, 16.0, 16.0, 16.0, 8.0]


def test_consecutive_hysteresis_refills_on_every_clean_step() -> None:
    plain = DynamicLossScaler(init_scale=16.0, scale_window=100, hysteresis=2)
    assert scales_after(plain, [T, F, T, F, T]) == [16.0, 16.0, 8.0, 8.0, 4.0]
    consecutive = DynamicLossScaler(init_scale=16.0, scale_window=100, hysteresis=2, consecutive_hysteresis=True)
    assert scales_after(consecutive, [T, F, T, F, T]) == [16.0] * 5
    # Back-to-back overflows still lower (the clean step first refills the countdown to 2).
    assert scales_after(consecutive, [F, T, T, T]) == [16.0, 16.0, 8.0, 4.0]


def test_min_scale_floor() -> None:
    scaler = DynamicLossScaler(init_scale=8.0, min_scale=3.0, hysteresis=1, scale_window=100)
    assert scales_after(scaler, [T, T, T, T]) == [4.0, 3.0, 3.0, 3.0]
    # The floor does not stop a later raise.
    scaler2 = DynamicLossScaler(init_scale=2.0, min_scale=1.0, hysteresis=1, scale_window=2)
    assert scales_after(scaler2, [T, T, F, F, F]) == [1.0, 1.0, 1.0, 1.0, 2.0]


def test_raise_error_at_min_scale() -> None:
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=2.0, hysteresis=1, raise_error_at_min_scale=True)
    assert scales_after(scaler, [T]) == [2.0]
    with pytest.raises(LossScaleError, match="min_loss_scale"):
        scaler.update(True)
    # With hysteresis left, an overflow at the minimum only spends the countdown.
    patient = DynamicLossScaler(init_scale=2.0, min_scale=2.0, hysteresis=2, raise_error_at_min_scale=True)
    patient.update(True)
    with pytest.raises(LossScaleError):
        patient.update(True)


def test_static_never_changes() -> None:
    scaler = StaticLossScaler(128.0)
    assert not scaler.dynamic
    assert scales_after(scaler, [T, T, F, T] + [F] * 3000) == [128.0] * 3004


@pytest.mark.parametrize("consecutive", [False, True])
def test_state_dict_resume_equals_uninterrupted(consecutive: bool) -> None:
    rng = random.Random(0)
    seq = [rng.random() < 0.3 for _ in range(200)]

    def make() -> DynamicLossScaler:
        return DynamicLossScaler(init_scale=2.0**10, scale_window=4, min_scale=1.0, hysteresis=3,
                                 consecutive_hysteresis=consecutive)

    ref = make()
    ref_scales = scales_after(ref, seq)
    first = make()
    head = scales_after(first, seq[:97])
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert head + scales_after(resumed, seq[97:]) == ref_scales
    assert resumed.state_dict() == ref.state_dict()
    assert len(set(ref_scales)) > 3  # the sequence actually moved the scale both ways


def test_static_state_dict_round_trip() -> None:
    scaler = StaticLossScaler(64.0)
    other = StaticLossScaler(64.0)
    other.load_state_dict(scaler.state_dict())
    assert other.loss_scale == 64.0 and other.state_dict() == scaler.state_dict()


def test_build_loss_scaler_maps_fp16_keys() -> None:
    keys: dict[str, Any] = dict(initial_scale_power=12, loss_scale_window=500, hysteresis=3,
                                consecutive_hysteresis=True, min_loss_scale=0.5)
    dyn = build_loss_scaler(loss_scale=0, **keys)
    assert isinstance(dyn, DynamicLossScaler) and dyn.dynamic
    assert (dyn.loss_scale, dyn.scale_window, dyn.hysteresis, dyn.min_scale) == (4096.0, 500, 3, 0.5)
    assert dyn.consecutive_hysteresis and not dyn.raise_error_at_min_scale
    static = build_loss_scaler(loss_scale=256.0, **keys)
    assert isinstance(static, StaticLossScaler) and static.loss_scale == 256.0


def test_defaults_match_deepspeed_fp16_defaults() -> None:
    scaler = DynamicLossScaler()
    assert (scaler.loss_scale, scaler.scale_factor, scaler.scale_window, scaler.min_scale, scaler.hysteresis) == (
        65536.0, 2.0, 1000, 1.0, 2)
    assert not scaler.consecutive_hysteresis and not scaler.raise_error_at_min_scale


def test_bad_values_name_the_fp16_key() -> None:
    base: dict[str, Any] = dict(loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2,
                consecutive_hysteresis=False, min_loss_scale=1.0)
    for key, value in (("loss_scale_window", 0), ("hysteresis", 0), ("min_loss_scale", -1.0)):
        with pytest.raises(ConfigError, match=f"fp16.{key}"):
            build_loss_scaler(**{**base, key: value})
    with pytest.raises(ConfigError, match="fp16.loss_scale"):
        build_loss_scaler(**{**base, "loss_scale": -2.0})
