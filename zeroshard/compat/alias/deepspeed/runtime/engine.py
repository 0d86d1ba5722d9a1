"""deepspeed.runtime.engine: DeepSpeedEngine is zeroshard's ZeroEngine (for isinstance and .module)."""

from zeroshard.runtime.engine import ZeroEngine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
