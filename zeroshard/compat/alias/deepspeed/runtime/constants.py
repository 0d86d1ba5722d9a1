"""deepspeed.runtime.constants: the defaults scripts compare against (zeroshard's schema values)."""

import dataclasses as _dc

from zeroshard.config import Config as _Config

_DEFAULTS = {f.name: f.default for f in _dc.fields(_Config) if f.default is not _dc.MISSING}

GRADIENT_CLIPPING = "gradient_clipping"
GRADIENT_CLIPPING_DEFAULT = float(_DEFAULTS["gradient_clipping"])
TRAIN_BATCH_SIZE = "train_batch_size"
TRAIN_MICRO_BATCH_SIZE_PER_GPU = "train_micro_batch_size_per_gpu"
GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"

__all__ = ["GRADIENT_CLIPPING", "GRADIENT_CLIPPING_DEFAULT", "TRAIN_BATCH_SIZE",
           "TRAIN_MICRO_BATCH_SIZE_PER_GPU", "GRADIENT_ACCUMULATION_STEPS"]
