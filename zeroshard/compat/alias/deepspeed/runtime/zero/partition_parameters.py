"""deepspeed.runtime.zero.partition_parameters, as transformers uses it around zero.Init.

transformers enters `zero_wrapper_for_fp_tensor_constructor` around `torch.arange` (keeping
`_orig_torch_arange`) while building a model under zero.Init. zeroshard's Init does not patch
torch's tensor constructors, so these are plain pass-throughs kept for name compatibility.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zeroshard.compat._names import reexport as _reexport
from zeroshard.compat.refused import refused_class as _refused

__getattr__, __dir__ = _reexport(__name__, {
    **{n: f"zeroshard.zero:{n}" for n in ["GatheredParameters", "register_external_parameter"]},
    "Init": "zeroshard.compat.comm:Init", "ZeroParamStatus": "zeroshard.zero.units:ZeroParamStatus",
    # Transformers' zero.Init wrapper (integrations/deepspeed.py) reads it off this module
    "get_accelerator": "zeroshard.accelerator:get_accelerator"})

_orig_torch_arange = torch.arange
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., Any], target_fp_dtype: torch.dtype) -> Callable[..., Any]:
    """Return `fn` unchanged: zeroshard's Init casts parameters as they are registered, not
    every floating tensor a constructor makes."""
    return fn


def get_all_parameters(sub_module: torch.nn.Module, recurse: bool = False) -> list[torch.nn.Parameter]:
    return list(sub_module.parameters(recurse=recurse))


# DeepSpeed's Init machinery: zeroshard's Init partitions parameters as modules register them
# (no subclass-patching of every nn.Module, no all-gather handle objects); refused by name.
InsertPostInitMethodToModuleSubClasses = _refused(
    "deepspeed.runtime.zero.partition_parameters.InsertPostInitMethodToModuleSubClasses",
    "zeroshard.zero.Init partitions parameters without patching nn.Module subclasses")
MultipleAllGatherHandles = _refused(
    "deepspeed.runtime.zero.partition_parameters.MultipleAllGatherHandles",
    "zeroshard's stage-3 gathers return ordinary pending handles inside the engine")
