"""deepspeed.runtime.zero.leaf_module_config: the `zero_optimization.leaf_module` section model
(read by zeroshard's config reader) and its default lists, DeepSpeed 0.19.8's (zero/leaf.py
marks what the section names at stage 3).
"""

from zeroshard.compat.ds_config import DeepSpeedZeroLeafModuleConfig
from zeroshard.config.schema_zero import DEFAULT_LEAF_MODULE_CLASSES as _CLASSES

DEFAULT_LEAF_MODULE_CLASSES = list(_CLASSES)
DEFAULT_LEAF_MODULE_NAMES: list = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list = []

__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES", "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
           "DeepSpeedZeroLeafModuleConfig"]
