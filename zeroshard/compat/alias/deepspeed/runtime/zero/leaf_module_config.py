"""deepspeed.runtime.zero.leaf_module_config: the default leaf-module lists.

The classes are the ones zeroshard marks at stage 3 when nothing else is marked (zero/leaf.py),
DeepSpeed 0.19.8's defaults. The `zero_optimization.leaf_module` config section itself is not
modelled by zeroshard's config (mark leaves with `set_z3_leaf_modules` / `_by_name` /
`_by_suffix`), so DeepSpeedZeroConfig has no `leaf_module` attribute.
"""

from zeroshard.zero.leaf import DEFAULT_LEAF_CLASSES as _CLASSES

DEFAULT_LEAF_MODULE_CLASSES = list(_CLASSES)
DEFAULT_LEAF_MODULE_NAMES: list = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list = []

__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES", "DEFAULT_LEAF_MODULE_NAME_SUFFIXES"]
