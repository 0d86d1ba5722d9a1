"""Auto-resume keeps the saved global batch at another data-parallel size, or refuses by name
(runtime/auto_resume.py's `keep_global_batch`; pure arithmetic on a Config, no process group)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from zeroshard.config import load_config
from zeroshard.errors import ConfigError
from zeroshard.runtime.auto_resume import keep_global_batch


def found(train_batch_size: int | None) -> SimpleNamespace:
    return SimpleNamespace(path=Path("ckpt/global_step4"), manifest=SimpleNamespace(train_batch_size=train_batch_size))


def test_recomputes_gradient_accumulation() -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}, dp_world_size=1)
    kept = keep_global_batch(cfg, found(8))
    assert (kept.train_batch_size, kept.gradient_accumulation_steps) == (8, 4)
    assert keep_global_batch(cfg, found(None)) is cfg and keep_global_batch(cfg, None) is cfg


def test_refuses_with_the_sizes_that_work() -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}, dp_world_size=3)
    with pytest.raises(ConfigError, match=r"train_batch_size 4, .* Sizes that keep it: data-parallel size one of "
                                          r"\[1, 2\] at train_micro_batch_size_per_gpu 2"):
        keep_global_batch(cfg, found(4))
    cfg = load_config({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}, dp_world_size=2)
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu one of \[1, 3\] at data-parallel size 2"):
        keep_global_batch(cfg, found(6))
