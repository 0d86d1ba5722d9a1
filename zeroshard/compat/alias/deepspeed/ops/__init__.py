from deepspeed.ops import adagrad, adam, lion
from zeroshard.compat.ds_utils import COMPATIBLE_OPS as _OPS

__compatible_ops__ = dict(_OPS)  # which compiled ops' features zeroshard provides (compat/ds_utils.py)
