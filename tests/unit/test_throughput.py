"""`engine.tput_timer` (runtime/throughput.py): DeepSpeed's ThroughputTimer interface, with the
warm-up steps, micro-steps and epochs DeepSpeed counts, fed by the engine's forward and step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.runtime import throughput
from zeroshard.runtime.throughput import ThroughputTimer


class Clock:
    """The timer's clock, advanced by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(throughput, "_clock", fake)
    return fake


def _micro_step(timer: ThroughputTimer, clock: Clock, seconds: float, boundary: bool, **kw: int) -> None:
    timer.start()
    clock.now += seconds
    timer.stop(global_step=boundary, **kw)


def test_average_skips_the_warm_up_steps_and_counts_each_micro_step(clock: Clock) -> None:
    timer = ThroughputTimer(batch_size=8, start_step=2)
    assert timer.avg_samples_per_sec() == float("-inf")  # no step yet, as DeepSpeed
    for seconds in (5.0, 5.0):  # warm-up: not timed
        _micro_step(timer, clock, seconds, boundary=True)
    assert timer.total_elapsed_time == 0 and timer.avg_samples_per_sec() == float("-inf")
    for _ in range(3):  # 3 optimizer steps of 2 micro-steps, 0.25 s each
        _micro_step(timer, clock, 0.25, boundary=False)
        clock.now += 10.0  # between step() and the next forward (data loading): not timed
        _micro_step(timer, clock, 0.25, boundary=True)
    assert (timer.global_step_count, timer.micro_step_count) == (5, 8)
    assert timer.total_elapsed_time == pytest.approx(1.5)
    assert timer.avg_samples_per_sec() == pytest.approx(3 * 8 / 1.5)
    timer.update_epoch_count()
    assert (timer.epoch_count, timer.micro_step_count, timer.global_step_count) == (1, 0, 5)


def test_stop_without_start_and_a_restarted_forward(clock: Clock) -> None:
    timer = ThroughputTimer(batch_size=4, start_step=0)
    timer.stop(global_step=True)  # never started: ignored, as DeepSpeed
    assert timer.global_step_count == 0
    timer.start()
    clock.now += 7.0  # an evaluation forward: a second start() restarts the clock
    timer.start()
    clock.now += 2.0
    timer.stop(global_step=True, samples=6)  # the engine's own count for this step
    assert timer.avg_samples_per_sec() == pytest.approx(6 / 2.0)


def test_reports_every_steps_per_output(clock: Clock) -> None:
    lines: list[str] = []
    timer = ThroughputTimer(batch_size=2, start_step=0, steps_per_output=2, logging_fn=lines.append)
    for _ in range(4):
        _micro_step(timer, clock, 0.5, boundary=True)
    assert len(lines) == 2 and lines[1].startswith("epoch=0/micro_step=4/global_step=4, RunningAvgSamplesPerSec=4.0")
    with pytest.raises(ValueError, match="steps_per_output"):
        ThroughputTimer(batch_size=1, steps_per_output=0)
    disabled = ThroughputTimer(config=type("Off", (), {"enabled": False})(), batch_size=1)
    _micro_step(disabled, clock, 1.0, boundary=True)
    assert disabled.global_step_count == 0


def test_engine_drives_its_tput_timer(clock: Clock) -> None:
    """Forward starts it, step() stops it; samples per optimizer step are the engine's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    engine, *_ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}})
    timer = engine.tput_timer
    assert isinstance(timer, ThroughputTimer) and timer.batch_size == 6
    x = torch.randn(3, 4)
    for _ in range(5 * 2):
        loss = engine(x).pow(2).mean()
        clock.now += 0.5
        engine.backward(loss)
        engine.step()
    assert (timer.global_step_count, timer.micro_step_count) == (5, 10) == (engine.global_steps, engine.micro_steps)
    assert timer.total_elapsed_time == pytest.approx(3 * 2 * 0.5)  # steps 3..5, two micro-steps each
    assert timer.avg_samples_per_sec() == pytest.approx(3 * 6 / 3.0)
    timer.update_epoch_count()  # what DeepSpeed-Chat's step 1 calls after each epoch
    assert timer.epoch_count == 1
