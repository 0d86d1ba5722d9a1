"""`deepspeed.utils.zero_to_fp32`'s functions, with DeepSpeed 0.19.8's signatures, over
zeroshard's own consolidation (checkpoint/to_fp32.py). No process group, no GPU needed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from zeroshard.checkpoint import to_fp32 as _impl
from zeroshard.checkpoint.manifest import resolve
from zeroshard.errors import CheckpointError, NotSupportedError


def _frozen_names(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> set[str]:
    resolved = resolve(checkpoint_dir, tag)
    if resolved is None:
        raise CheckpointError(f"{checkpoint_dir}: no `latest` file; pass tag=")
    _, manifest = resolved
    frozen = {p.name for p in manifest.params if not p.trainable}
    return frozen | {a for a, n in manifest.aliases.items() if n in frozen}


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike[str], tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, Tensor]:
    """The checkpoint's full fp32 state dict on CPU (DeepSpeed's signature).

    Args:
        checkpoint_dir: the directory given to `engine.save_checkpoint`.
        tag: the checkpoint; default the one `latest` names.
        exclude_frozen_parameters: leave out parameters saved with requires_grad=False.
        lazy_mode: not supported (tensors are always materialised).
    """
    if lazy_mode:
        raise NotSupportedError("get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True) is not supported; "
                                "zeroshard already assembles tensors chunk by chunk, so drop lazy_mode")
    state = _impl.get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    if exclude_frozen_parameters:
        frozen = _frozen_names(checkpoint_dir, tag)
        state = {k: v for k, v in state.items() if k not in frozen}
    return state


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike[str],
                                         tag: str | None = None) -> nn.Module:
    """Copy the checkpoint's fp32 weights into `model` (on CPU) and return it."""
    return _impl.load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike[str],
                                               output_dir: str | os.PathLike[str], max_shard_size: Any = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> Any:
    """Write the fp32 state dict into `output_dir` as `pytorch_model.bin` (torch.save) or
    `model.safetensors` (`safe_serialization=True`), as one file whatever `max_shard_size`.

    Raises:
        NotSupportedError: `exclude_frozen_parameters=True` (use
            `get_fp32_state_dict_from_zero_checkpoint(..., exclude_frozen_parameters=True)`).
    """
    if exclude_frozen_parameters:
        raise NotSupportedError(
            "convert_zero_checkpoint_to_fp32_state_dict(exclude_frozen_parameters=True) is not supported; "
            "call get_fp32_state_dict_from_zero_checkpoint(..., exclude_frozen_parameters=True) and save it")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    return _impl.convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, out / name, tag,
                                                            safetensors=safe_serialization, progress=False)


__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]
