"""0/1 Adam's schedules (optim/zero_one_adam.py) against DeepSpeed's counter rules, simulated step by
step as its ZeroOneAdam.step keeps them (var_interval/var_counter, local_step_interval/counter)."""

from __future__ import annotations

import pytest

from zeroshard.optim.zero_one_adam import local_step_interval, variance_update_step


def _ds_variance_steps(steps: int, scaler: int) -> list[bool]:
    interval, counter, out = 1, 0, []
    for step in range(1, steps + 1):
        hit = step % interval == 0
        out.append(hit)
        if hit:
            counter += 1
            if counter == scaler:
                counter, interval = 0, interval * 2
    return out


def _ds_local_intervals(first: int, steps: int, scaler: int, clipper: int) -> list[int]:
    interval, counter, out = 1, 0, []
    for _ in range(first, first + steps):
        out.append(interval)
        counter += 1
        if counter == scaler:
            counter, interval = 0, min(clipper, interval * 2)
    return out


@pytest.mark.parametrize("scaler", [1, 2, 3, 16])
def test_variance_schedule_matches_counter_rules(scaler: int) -> None:
    want = _ds_variance_steps(3000, scaler)
    got = [variance_update_step(t, scaler) for t in range(1, 3001)]
    assert got == want
    assert all(got[:scaler]) and sum(got) < 3000  # dense at first, then thinning


def test_variance_schedule_spacing_doubles() -> None:
    steps = [t for t in range(1, 200) if variance_update_step(t, 4)]
    assert steps[:12] == [1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 28]


@pytest.mark.parametrize(("scaler", "clipper"), [(1, 16), (2, 4), (3, 5), (32678, 16)])
def test_local_interval_matches_counter_rules(scaler: int, clipper: int) -> None:
    freeze = 7
    want = _ds_local_intervals(freeze + 1, 400, scaler, clipper)
    got = [local_step_interval(t, freeze, scaler, clipper) for t in range(freeze + 1, freeze + 401)]
    assert got == want
    assert max(got) <= clipper


def test_schedule_input_checks() -> None:
    with pytest.raises(ValueError, match="step 0"):
        variance_update_step(0, 16)
    with pytest.raises(ValueError, match="variance phase"):
        local_step_interval(5, 5, 2, 4)
