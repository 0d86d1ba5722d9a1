"""`from_pretrained` at ZeRO-3 under the alias: each rank reads only its own shard from safetensors.

Transformers loads a checkpoint into a model built under `zero.Init` in
`PreTrainedModel._load_pretrained_model`: rank 0 reads every tensor of every file and, module
by module, `deepspeed.zero.GatheredParameters(params, modifier_rank=0)` gathers the layer on
every rank, rank 0 copies the checkpoint values in and broadcasts them, and each rank cuts its
1/N again (`integrations/deepspeed.py: _load_state_dict_into_zero3_model`). Rank 0 thus reads
(and keeps resident while mapped) the whole model, and every byte crosses the network.

When the alias is active, `install_transformers_hook()` wraps `_load_pretrained_model`. If the
checkpoint is safetensors files and the model's parameters are `zero.Init` shards, each rank
opens the files (`safetensors.safe_open`) and reads only the rows that cover its own 1/N of each
tensor straight into its shard: no gather, no broadcast, and per rank about model/N plus one
tensor's slice in memory. Anything else (`.bin` files, a state dict passed in, weight
converters that fuse or split tensors, quantization, a disk `device_map`, parameters already
taken over by an engine) takes Transformers' own path, unchanged. `ZEROSHARD_SHARDED_FROM_PRETRAINED=0`
forces Transformers' path. Rank 0 prints which path a load took (silenced by ZEROSHARD_ALIAS_QUIET).

Imports transformers and safetensors only inside functions: the alias must stay importable
without them.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from zeroshard.zero.init_partition import InitPartitioner
from zeroshard.zero.units import ZeroParameter, zero_state

ENV_VAR = "ZEROSHARD_SHARDED_FROM_PRETRAINED"
"""Set to 0 to make `from_pretrained` at ZeRO-3 take Transformers' gather-and-broadcast path."""

_HOOK_MARK = "__zeroshard_sharded_load__"


def install_transformers_hook() -> bool:
    """Wrap `transformers.PreTrainedModel._load_pretrained_model` with the sharded load (idempotent).

    Does nothing (returns False) when transformers' modeling code is not imported yet: the alias
    calls this again from `deepspeed.zero.Init`, which Transformers enters before every ZeRO-3
    `from_pretrained` loads its weights.
    """
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return False
    cls = modeling.PreTrainedModel
    current = cls.__dict__.get("_load_pretrained_model")
    if current is None:
        return False
    original = current.__func__ if isinstance(current, staticmethod) else current
    if getattr(original, _HOOK_MARK, False):
        return True
    if not _loader_takes_load_config(current):
        return False  # transformers 4.x's classmethod loader: its own ZeRO-3 path, untouched

    def _load_pretrained_model(model: nn.Module, state_dict: dict | None, checkpoint_files: list[str] | None,
                               load_config: Any, expected_keys: list[str] | None = None) -> Any:
        reason = _why_not_sharded(model, state_dict, checkpoint_files, load_config)
        if reason is None:
            info = load_sharded(model, checkpoint_files or [], load_config)
            return info, None
        if reason == _NOT_ZERO3:
            return original(model, state_dict, checkpoint_files, load_config, expected_keys)
        _say(f"from_pretrained at ZeRO-3: Transformers' path (rank 0 reads, each layer is gathered "
             f"and broadcast): {reason}")
        with _state_dict_keeps_vars(model):
            return original(model, state_dict, checkpoint_files, load_config, expected_keys)

    setattr(_load_pretrained_model, _HOOK_MARK, True)
    _load_pretrained_model.__wrapped__ = original  # type: ignore[attr-defined]
    cls._load_pretrained_model = staticmethod(_load_pretrained_model)
    return True


_NOT_ZERO3 = "ZeRO-3 is not enabled"


def _loader_takes_load_config(loader: Any) -> bool:
    """True for the loader this wrapper is written against, transformers 5's static
    `_load_pretrained_model(model, state_dict, checkpoint_files, load_config, expected_keys)`;
    transformers 4.x has a classmethod with another argument list (ignore_mismatched_sizes, ...),
    which the [hf] extra's range still admits (DeepSpeed-Chat pins 4.x)."""
    import inspect

    if not isinstance(loader, staticmethod):
        return False
    names = list(inspect.signature(loader.__func__).parameters)
    return names[:4] == ["model", "state_dict", "checkpoint_files", "load_config"]


@contextmanager
def _state_dict_keeps_vars(model: nn.Module) -> Iterator[None]:
    """Transformers' ZeRO-3 load reads `model.state_dict()` for its keys, shapes and dtypes only;
    a plain `state_dict()` detaches every parameter, which a zeroshard shard refuses outside a
    gather (DeepSpeed's shards are empty tensors and allow it). For the duration of the load the
    model's `state_dict` returns the parameters themselves (keep_vars=True)."""
    bound = model.state_dict

    def state_dict(*args: Any, **kwargs: Any) -> Any:
        kwargs["keep_vars"] = True
        return bound(*args, **kwargs)

    model.state_dict = state_dict  # type: ignore[method-assign]
    try:
        yield
    finally:
        del model.state_dict


def _why_not_sharded(model: nn.Module, state_dict: dict | None, checkpoint_files: Sequence[str] | None,
                     load_config: Any) -> str | None:
    """None when the sharded load applies; otherwise why not, in words."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return _NOT_ZERO3
    if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"{ENV_VAR}=0"
    if getattr(load_config, "is_quantized", False) or getattr(load_config, "hf_quantizer", None) is not None:
        return "a quantized model"
    if state_dict is not None:
        return "a state_dict was passed in"
    if not checkpoint_files:
        return "no checkpoint files"
    if not all(str(f).endswith(".safetensors") for f in checkpoint_files):
        return "the checkpoint is not safetensors (e.g. pytorch_model.bin)"
    device_map = getattr(load_config, "device_map", None)
    if device_map is not None:
        return "a device_map was given"
    if _converters(load_config):
        return "the model's weight conversions fuse or split checkpoint tensors"
    partitioned = 0
    for name, p in model.named_parameters():
        state = zero_state(p)
        if state is None:
            continue
        if not isinstance(state.owner, InitPartitioner) or state.init_shard is None or state.gathered:
            return f"parameter {name} is not a zero.Init shard (already taken over by an engine, or gathered)"
        partitioned += 1
    if partitioned == 0:
        return "the model was not built under zero.Init"
    return None


def _converters(load_config: Any) -> list[Any]:
    from transformers.core_model_loading import WeightConverter

    return [m for m in getattr(load_config, "weight_mapping", None) or [] if isinstance(m, WeightConverter)]


def _say(message: str, when: bool = True) -> None:
    import logging

    logging.getLogger("zeroshard").info(message)
    if when and os.environ.get("RANK", "0") == "0" and not os.environ.get("ZEROSHARD_ALIAS_QUIET"):
        print(f"[zeroshard] {message}", file=sys.stderr, flush=True)


@torch.no_grad()
def load_sharded(model: nn.Module, checkpoint_files: Sequence[str], load_config: Any) -> Any:
    """Fill `model`'s `zero.Init` shards from safetensors files, each rank reading its own slices.

    Parameters that are not partitioned and buffers are read whole on every rank. Every loaded
    parameter and buffer is marked `_is_hf_initialized` (Transformers then leaves it alone).

    Returns:
        Transformers' `LoadStateDictInfo` for the load.
    """
    from safetensors import safe_open
    from transformers.core_model_loading import WeightRenaming, rename_source_key
    from transformers.utils.loading_report import LoadStateDictInfo

    targets: dict[str, Tensor] = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    expected = set(model.state_dict(keep_vars=True).keys())  # keep_vars: no detach of a shard
    renamings = [m for m in getattr(load_config, "weight_mapping", None) or [] if isinstance(m, WeightRenaming)]
    prefix = getattr(model, "base_model_prefix", "") or ""
    meta = {k: torch.empty(0, device="meta") for k in expected}
    loaded: set[str] = set()
    unexpected: set[str] = set()
    errors: list[str] = []
    for path in checkpoint_files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                name = rename_source_key(key, renamings, [], base_model_prefix=prefix, meta_state_dict=meta)[0] \
                    if renamings else key
                if name not in targets and f"{prefix}.{name}" in targets:
                    name = f"{prefix}.{name}"
                target = targets.get(name)
                if target is None:
                    unexpected.add(key)
                    continue
                error = _load_one(f, key, name, target)
                if error:
                    errors.append(error)
                    continue
                loaded.add(name)
                target._is_hf_initialized = True  # type: ignore[attr-defined]
    files = len(checkpoint_files)
    world = _world_size(model)
    _say(f"from_pretrained at ZeRO-3: sharded load, each of {world} rank(s) read its own slices of "
         f"{len(loaded)} tensors from {files} safetensors file(s) (no gather, no broadcast)")
    return LoadStateDictInfo(missing_keys=expected - loaded, unexpected_keys=unexpected, mismatched_keys=set(),
                             error_msgs=errors, conversion_errors={}, skipped_pp_keys=set())


def _load_one(f: Any, key: str, name: str, target: Tensor) -> str | None:
    """Copy checkpoint tensor `key` into model tensor `name` (its own slice for a shard)."""
    view = f.get_slice(key)
    shape = tuple(view.get_shape())
    if shape != tuple(target.shape):
        return (f"size mismatch for {name}: copying a param with shape {torch.Size(shape)} from checkpoint, "
                f"the shape in current model is {target.shape}.")
    state = zero_state(target)
    if isinstance(target, ZeroParameter) and state is not None and isinstance(state.owner, InitPartitioner):
        start, end = state.owner.owned_range(target)
        state.owner.load_shard(target, read_flat_range(view, shape, start, end))
    else:
        target.copy_(f.get_tensor(key))
    return None


def read_flat_range(view: Any, shape: tuple[int, ...], start: int, end: int) -> Tensor:
    """Elements [start, end) of a safetensors tensor's flattened values, reading only the rows
    (along dim 0) that hold them: at most one partial row more on each side."""
    if end <= start:
        return torch.empty(0)
    if len(shape) <= 1:
        return view[start:end] if shape else view[...].reshape(-1)
    row = math.prod(shape[1:])
    first, last = start // row, -(-end // row)
    rows = view[first:last].reshape(-1)  # [(last - first) * row]
    return rows[start - first * row : end - first * row]


def _world_size(model: nn.Module) -> int:
    for p in model.parameters():
        state = zero_state(p)
        if state is not None and isinstance(state.owner, InitPartitioner):
            return state.owner.world_size
    return 1

