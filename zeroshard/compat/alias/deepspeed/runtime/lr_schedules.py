"""deepspeed.runtime.lr_schedules -> zeroshard.runtime.lr_schedules (same class names)."""

from zeroshard.compat._names import reexport as _reexport

_NAMES = ["VALID_LR_SCHEDULES", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR",
          "WARMUP_COSINE_LR", "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR",
          "WarmupCosineLR"]
__getattr__, __dir__ = _reexport(__name__, {n: f"zeroshard.runtime.lr_schedules:{n}" for n in _NAMES})
