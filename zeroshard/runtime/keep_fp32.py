"""`data_types.keep_in_fp32_modules`: the floating-point buffers that stay fp32 under bf16/fp16.

Hugging Face models list the tensors that must not be rounded in two class attributes:
`_keep_in_fp32_modules_strict` (fp32 under bf16 and fp16) and `_keep_in_fp32_modules` (fp32
under fp16 only); Transformers honours them when it builds a model itself. An MoE router's
`e_score_correction_bias` (DeepSeek-V3, GLM-4.5) is such a buffer: its values sit close together
where bf16's steps are coarse, and rounding them changes which experts tokens reach.

DeepSpeed 0.19.8 reads the same lists (its `keep_in_fp32_modules`, default "auto"), and so does
this module: the names become patterns (`*` any characters; a submodule's names are prefixed by
its path), matched anywhere in a buffer's full name. Only buffers are affected; parameters follow
the training dtype.
"""

from __future__ import annotations

import re

import torch
from torch import nn


def keep_fp32_pattern(model: nn.Module, setting: tuple[str, ...] | None,
                      dtype: torch.dtype | None) -> re.Pattern[str] | None:
    """The names to keep in fp32 for training in `dtype`, as one pattern; None when nothing is
    kept (fp32 training, an empty list, a model without lists). `setting` None is "auto"."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    patterns: set[str] = set()
    if setting is None:
        for path, sub in model.named_modules():
            names = set(getattr(sub, "_keep_in_fp32_modules_strict", None) or ())
            if dtype == torch.float16:
                names |= set(getattr(sub, "_keep_in_fp32_modules", None) or ())
            for name in names:
                glob = name.replace("*", ".*")
                patterns.add(rf"^{re.escape(path)}\..*{glob}" if path else glob)
    else:
        patterns = {name.replace("*", ".*") for name in setting}
    return re.compile("|".join(sorted(patterns))) if patterns else None


def fp32_buffers(model: nn.Module, pattern: re.Pattern[str] | None) -> dict[int, str]:
    """id -> full name of the floating-point buffers `pattern` names (none without a pattern)."""
    if pattern is None:
        return {}
    return {id(b): name for name, b in model.named_buffers()
            if b is not None and b.is_floating_point() and pattern.search(name)}
