"""Small public DeepSpeed helpers that scripts and DeepSpeed's own tests import by name, written
for zeroshard: version checks, the accelerator query, checkpoint file names, the log level,
`unwrap_model_for_generation`, and which of DeepSpeed's compiled ops have a zeroshard counterpart."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from packaging import version as _version


def required_torch_version(min_version: str | float | None = None, max_version: str | float | None = None) -> bool:
    """True when the installed torch is within [min_version, max_version] (either may be None).

    Raises:
        ValueError: neither bound is given.
    """
    if not min_version and not max_version:
        raise ValueError("required_torch_version: give min_version, max_version or both")
    installed = _version.parse(torch.__version__.split("+")[0])
    if min_version and _version.parse(str(min_version)) > installed:
        return False
    return not (max_version and _version.parse(str(max_version)) < installed)


SUPPORTED_ACCELERATORS = ("cpu", "cuda", "xpu", "mps", "npu", "hpu", "mlu")
"""Device types zeroshard's accelerator runs on (torch.accelerator's types; mps without collectives)."""


def is_current_accelerator_supported() -> bool:
    """True when the current accelerator's device type is one zeroshard runs on."""
    from zeroshard.accelerator import get_accelerator

    return get_accelerator().device_name() in SUPPORTED_ACCELERATORS


def torch_info() -> dict[str, str]:
    """DeepSpeed's `git_version_info.torch_info`: torch's "major.minor", and CUDA's and NCCL's
    ("0.0" when absent), read from the installed torch."""
    cuda = torch.version.cuda or "0.0"
    nccl = "0.0"
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version()[:2])
        except (AttributeError, RuntimeError):  # NCCL not built in
            nccl = "0.0"
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return {"version": major_minor, "bf16_support": "True", "cuda_version": ".".join(cuda.split(".")[:2]),
            "nccl_version": nccl, "hip_version": "0.0"}


def _natural_key(path: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def get_optim_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """The `*_optim_states.pt` files of a checkpoint directory, in rank order (numbers compared
    as numbers, so rank 10 follows rank 9).

    Raises:
        FileNotFoundError: the directory holds no such file.
    """
    files = [str(p) for p in Path(checkpoint_dir).glob("*_optim_states.pt")]
    if not files:
        raise FileNotFoundError(f"no *_optim_states.pt file in {checkpoint_dir}; is it a checkpoint's tag directory?")
    return sorted(files, key=_natural_key)


def get_model_ckpt_name_for_rank(base_folder: str | os.PathLike[str], mp_rank_str: str) -> str:
    """The model-states file of model-parallel rank `mp_rank_str` ("00") in a tag directory
    (`mp_rank_00_model_states.pt`, the name zeroshard and DeepSpeed both write)."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Set a logger's level (zeroshard's logger by default) and its handlers' from a name.

    Raises:
        ValueError: the name is not debug, info, warning, error or critical.
    """
    level = _LEVELS.get(str(log_level_str).lower())
    if level is None:
        raise ValueError(f"log level {log_level_str!r}: expected one of {', '.join(_LEVELS)}")
    from zeroshard.utils import logger

    target = custom_logger or logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


@contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """`deepspeed.runtime.zero.unwrap_model_for_generation`: gather every stage-3 parameter of an
    engine (or module) whole for the block and yield `model` itself, as DeepSpeed does (TRL's
    helper of the same name, zeroshard.utils', yields the inner module). Below stage 3 nothing is
    gathered. zeroshard's forward hooks stay installed and find the parameters already whole."""
    from zeroshard.runtime.inference import unwrap_model_for_generation as gathered

    with gathered(model):
        yield model


COMPATIBLE_OPS = {"cpu_adam": True, "cpu_adagrad": True, "cpu_lion": False, "fused_adam": True,
                  "fused_lamb": True, "async_io": True, "deepspeed_not_implemented": False}
"""DeepSpeed's `ops.__compatible_ops__` under zeroshard: whether zeroshard runs the feature that
DeepSpeed's compiled op backs (CPU-offloaded Adam and Adagrad, fused Adam and LAMB on the
device, NVMe offload; no Lion). zeroshard compiles no ops; the builders themselves are refused by name."""
