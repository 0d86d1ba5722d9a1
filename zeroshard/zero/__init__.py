"""Partitioning strategies behind one interface (zero/strategy.py); `build_strategy` picks one."""

from zeroshard.zero.stage0 import Stage0Strategy, broadcast_module_state
from zeroshard.zero.strategy import GradStats, ModelStateBytes, ZeroStrategy

__all__ = ["GradStats", "ModelStateBytes", "Stage0Strategy", "ZeroStrategy", "broadcast_module_state"]
