"""DeepSpeed's activation-checkpointing API (`deepspeed.checkpointing`), built on torch.utils.checkpoint.

Public as `zeroshard.checkpointing`. A checkpointed region keeps only its inputs during forward
and runs again in backward to rebuild what backward needs; torch.utils.checkpoint does the
autograd work, this module adds what DeepSpeed scripts expect around it: the module-wide
settings of `configure()` / the `activation_checkpointing` config block, DeepSpeed's named RNG
tracker (restored for the recompute, Note: [rng of the recompute]), the recompute timer
(`profile`) and CPU homes for checkpointed inputs (`cpu_checkpointing`). Imports nothing
of ours but `config` and `errors`; never torch.distributed.

Note: [rng of the recompute] The recompute must draw the same dropout masks as the forward.
torch.utils.checkpoint restores the default CPU and device generators (preserve_rng_state).
DeepSpeed/Megatron scripts also draw from a named state (`get_cuda_rng_tracker().fork()`),
which the forward advanced; `_Region` snapshots the tracker's states when the region first
runs and restores that snapshot around each recompute, then puts back the states the rest of
training has reached.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor

from zeroshard.config.load import check_contiguous_checkpointing
from zeroshard.errors import ConfigError, NotSupportedError

logger = logging.getLogger("zeroshard")

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""The tracker state DeepSpeed (and Megatron) scripts fork for model-parallel regions."""


@dataclass(frozen=True, slots=True)
class ActivationCheckpointingSettings:
    """What `configure()` set; the defaults are DeepSpeed 0.19.8's."""

    partition_activations: bool = False
    """Accepted as a no-op: with one model-parallel rank there is nothing to partition."""
    contiguous_checkpointing: bool = False
    """Accepted as a no-op (docs/deepspeed-differences.md); needs num_checkpoints, as in DeepSpeed."""
    num_checkpoints: int | None = None
    cpu_checkpointing: bool = False
    """Keep checkpointed inputs in CPU memory (a no-op when the inputs already are on CPU)."""
    synchronize: bool = False
    """Synchronize the device before and after each checkpointed forward and recompute."""
    profile: bool = False
    """Add the recompute time to `recompute_seconds()` (the engine's wall-clock breakdown)."""


CheckpointingSettings = ActivationCheckpointingSettings
"""The name `zeroshard.checkpointing` exported before the class said which checkpointing it is."""

_settings: ActivationCheckpointingSettings | None = None
_mpu: Any = None
"""The model-parallel unit given to `configure()` (its tensor-parallel rank offsets the seed)."""
_recompute_s = 0.0
_forward_s = 0.0


# -- RNG ----------------------------------------------------------------------------------


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_device_rng() -> Tensor:
    return torch.cuda.get_rng_state() if _device_type() == "cuda" else torch.get_rng_state()


def _set_device_rng(state: Tensor) -> None:
    if _device_type() == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _device_manual_seed(seed: int) -> None:
    if _device_type() == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class RNGStatesTracker:
    """Named generator states of the accelerator (the CPU generator on a CPU-only machine).

    `add(name, seed)` creates a state; `with tracker.fork(name):` draws from it and keeps its
    advance, leaving the default generator untouched. DeepSpeed's `CudaRNGStatesTracker`.
    """

    def __init__(self) -> None:
        self._states: dict[str, Tensor] = {}
        self._seeds: set[int] = set()

    def reset(self) -> None:
        self._states, self._seeds = {}, set()

    def get_states(self) -> dict[str, Tensor]:
        """A copy of the name -> state mapping (the states themselves are replaced, not changed)."""
        return copy.copy(self._states)

    def set_states(self, states: Mapping[str, Tensor]) -> None:
        self._states = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self._seeds:
            raise ValueError(f"RNG tracker: seed {seed} is already used by another state")
        if name in self._states:
            raise ValueError(f"RNG tracker: a state named {name!r} already exists; call reset() first")
        self._seeds.add(seed)
        before = _get_device_rng()
        _device_manual_seed(seed)
        self._states[name] = _get_device_rng()
        _set_device_rng(before)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self._states:
            raise ValueError(f"RNG tracker: no state named {name!r}; call "
                             "zeroshard.checkpointing.model_parallel_cuda_manual_seed(seed) first")
        before = _get_device_rng()
        _set_device_rng(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_device_rng()
            _set_device_rng(before)


_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (DeepSpeed's name; it tracks the CPU generator without CUDA)."""
    return _TRACKER


def _tensor_parallel_rank() -> int:
    """The tensor-parallel rank of the mpu given to `configure()` (0 without one), read as
    DeepSpeed's `bwc_tensor_model_parallel_rank` reads it."""
    if _mpu is None:
        return 0
    for name in ("get_tensor_model_parallel_rank", "get_model_parallel_rank", "get_slice_parallel_rank"):
        if hasattr(_mpu, name):
            return int(getattr(_mpu, name)())
    return 0


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator with `seed` and the tracker's model-parallel state with
    `seed + 2718 + tensor-parallel rank`, as DeepSpeed does (the rank comes from the mpu given to
    `configure()`, 0 without one). Forward and recompute draw the same masks from both (Note:
    [rng of the recompute])."""
    tp_rank = _tensor_parallel_rank()
    _TRACKER.reset()
    _device_manual_seed(seed)
    if _device_type() != "cpu":
        torch.manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Re-seed only the tracker's model-parallel state, to `seed + 2718 + tensor-parallel rank`
    (DeepSpeed's call for Megatron's tensor-parallel seed after a resize); the default generator
    is left as it is. Needs `model_parallel_cuda_manual_seed` first, as in DeepSpeed."""
    with _TRACKER.fork():
        _device_manual_seed(seed + 2718 + _tensor_parallel_rank())


# -- configuration ------------------------------------------------------------------------


def _model_parallel_size(mpu: Any) -> int:
    if mpu is None:
        return 1
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        if hasattr(mpu, name):
            return int(getattr(mpu, name)())
    return 1


def _section_from(deepspeed_config: Any) -> Any:
    """The `activation_checkpointing` section of a path, dict or zeroshard Config, validated."""
    from zeroshard.config import Config, load_config, read_config_file

    if isinstance(deepspeed_config, Config):
        return deepspeed_config.activation_checkpointing
    if isinstance(deepspeed_config, (str, os.PathLike)):
        raw: Mapping[str, Any] = read_config_file(deepspeed_config)
    elif isinstance(deepspeed_config, Mapping):
        raw = deepspeed_config
    else:
        raise ConfigError(f"configure(deepspeed_config=...): got a {type(deepspeed_config).__name__}, "
                          "expected a path to a ds_config JSON file, a dict or a zeroshard Config")
    # Only this section matters here: validate it alone (unknown keys, types) with a batch size
    # that cannot fail, so a script's full ds_config need not be resolvable in this process.
    section = raw.get("activation_checkpointing", {})
    return load_config({"train_batch_size": 1, "activation_checkpointing": section},
                       dp_world_size=1).activation_checkpointing


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """Set how `checkpoint()` runs, as `deepspeed.checkpointing.configure`.

    Settings start from DeepSpeed's defaults, then the `activation_checkpointing` section of
    `deepspeed_config`, then each keyword that is not None.

    Args:
        mpu_: a model-parallel unit (`get_model_parallel_world_size()` or the tensor-parallel
            name) or None. zeroshard has no model parallelism: its size must be 1 when
            `partition_activations` is on.
        deepspeed_config: a ds_config path, dict or `zeroshard.Config`.
        partition_activations: split checkpoints over model-parallel ranks; a no-op at size 1.
        contiguous_checkpointing: DeepSpeed's contiguous buffers; accepted, no effect
            (needs `num_checkpoints` and `partition_activations`, as in DeepSpeed).
        num_checkpoints: number of checkpointed regions per forward (for the above).
        checkpoint_in_cpu: keep checkpointed inputs in CPU memory until the recompute.
        synchronize: synchronize the device at each checkpoint boundary.
        profile: time the recomputes (`recompute_seconds()`; the engine's wall-clock breakdown).

    Raises:
        NotSupportedError: partition_activations with a model-parallel size above 1.
        ConfigError: contiguous_checkpointing without num_checkpoints or partition_activations.

    Example::

        zeroshard.checkpointing.configure(None, deepspeed_config="ds_config.json")
        hidden = zeroshard.checkpointing.checkpoint(block, hidden)
    """
    global _settings, _mpu
    values: dict[str, Any] = {}
    if deepspeed_config is not None:
        sec = _section_from(deepspeed_config)
        values = dict(partition_activations=sec.partition_activations,
                      contiguous_checkpointing=sec.contiguous_memory_optimization,
                      num_checkpoints=sec.number_checkpoints, cpu_checkpointing=sec.cpu_checkpointing,
                      synchronize=sec.synchronize_checkpoint_boundary, profile=sec.profile)
    overrides = dict(partition_activations=partition_activations, contiguous_checkpointing=contiguous_checkpointing,
                     num_checkpoints=num_checkpoints, cpu_checkpointing=checkpoint_in_cpu,
                     synchronize=synchronize, profile=profile)
    values.update({k: v for k, v in overrides.items() if v is not None})
    settings = ActivationCheckpointingSettings(**values)
    tp_size = _model_parallel_size(mpu_)
    if settings.partition_activations and tp_size > 1:
        raise NotSupportedError(
            f"not supported yet: activation_checkpointing.partition_activations=true with a "
            f"model-parallel size of {tp_size}. zeroshard has no model parallelism to partition "
            "activations over. Set partition_activations to false.")
    check_contiguous_checkpointing(settings.contiguous_checkpointing, settings.partition_activations,
                                   settings.num_checkpoints)
    _settings, _mpu = settings, mpu_
    logger.info(f"activation checkpointing: {settings}")


def is_configured() -> bool:
    """True once `configure()` ran (DeepSpeed's meaning)."""
    return _settings is not None


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here; zeroshard keeps none. Kept for scripts
    that call it after evaluation forwards."""


def settings() -> ActivationCheckpointingSettings:
    """The settings in force (DeepSpeed's defaults until `configure()`)."""
    return _settings if _settings is not None else ActivationCheckpointingSettings()


def recompute_seconds(*, reset: bool = True) -> float:
    """Seconds spent recomputing checkpointed regions since the last call (with `profile`)."""
    global _recompute_s
    value = _recompute_s
    if reset:
        _recompute_s = 0.0
    return value


def _unconfigure() -> None:
    """Back to "never configured" (tests)."""
    global _settings, _recompute_s, _mpu
    _settings, _recompute_s, _mpu = None, 0.0, None


# -- checkpoint ---------------------------------------------------------------------------


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Region:
    """The checkpointed function plus what its recompute must restore (Note: [rng of the recompute])."""

    def __init__(self, function: Callable[..., Any], opts: ActivationCheckpointingSettings, kwarg_keys: tuple[str, ...],
                 n_positional: int, homes: list[torch.device | None] | None) -> None:
        self._function, self._opts = function, opts
        self._kwarg_keys, self._n_positional = kwarg_keys, n_positional
        self._homes = homes
        """Per argument: the device a CPU-kept tensor input goes back to (cpu_checkpointing)."""
        self._tracker_states: dict[str, Tensor] | None = None
        self._home_rng: dict[int, Tensor] = {}

    def _call(self, args: tuple[Any, ...]) -> Any:
        if self._homes is not None:
            args = tuple(a.to(home) if home is not None else a for a, home in zip(args, self._homes))
        positional = args[: self._n_positional]
        keywords = dict(zip(self._kwarg_keys, args[self._n_positional :]))
        return self._function(*positional, **keywords)

    def _cuda_homes(self) -> list[int]:
        return sorted({h.index if h.index is not None else torch.cuda.current_device()
                       for h in self._homes or [] if h is not None and h.type == "cuda"})

    def __call__(self, *args: Any) -> Any:
        if self._tracker_states is None:  # the forward
            self._tracker_states = _TRACKER.get_states()
            # Inputs kept on CPU hide their device from torch.utils.checkpoint, which then does
            # not stash that device's generator: keep it here for the recompute.
            self._home_rng = {d: torch.cuda.get_rng_state(d) for d in self._cuda_homes()}
            return self._call(args)
        reached = _TRACKER.get_states()  # a recompute: replay the forward's tracker states
        _TRACKER.set_states(self._tracker_states)
        if self._opts.synchronize:
            _sync()
        start = time.perf_counter()
        stack = contextlib.ExitStack()
        try:
            if self._home_rng:
                stack.enter_context(torch.random.fork_rng(devices=list(self._home_rng), device_type="cuda"))
                for device, state in self._home_rng.items():
                    torch.cuda.set_rng_state(state, device)
            return self._call(args)
        finally:
            stack.close()
            if self._opts.synchronize or self._opts.profile:
                _sync()
            if self._opts.profile:
                global _recompute_s
                _recompute_s += time.perf_counter() - start
            _TRACKER.set_states(reached)


def _checkpoint(function: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any],
                reentrant: bool) -> Any:
    opts = settings()
    flat = tuple(args) + tuple(kwargs.values())
    homes: list[torch.device | None] | None = None
    if opts.cpu_checkpointing:
        # Keep what the region saves (its inputs) in CPU memory; `_Region._call` moves them back
        # for the forward and the recompute. The copies are autograd ops: gradients flow back.
        homes = [a.device if isinstance(a, Tensor) and a.device.type != "cpu" else None for a in flat]
        flat = tuple(a.to("cpu") if home is not None else a for a, home in zip(flat, homes))
    region = _Region(function, opts, tuple(kwargs), len(args), homes)
    if opts.synchronize:
        _sync()
    out = torch_checkpoint.checkpoint(region, *flat, use_reentrant=reentrant, preserve_rng_state=True)
    if opts.synchronize:
        _sync()
    return out


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `function(*args, **kwargs)` without keeping its activations; recompute them in backward.

    DeepSpeed's `deepspeed.checkpointing.checkpoint`: reentrant, as DeepSpeed's is (the
    recompute runs its own backward), so at least one tensor input must require grad for
    gradients to flow into the region's parameters (HF's `enable_input_require_grads()`).
    Dropout draws the same masks in the recompute, from the default generators and from
    `get_cuda_rng_tracker()` states. Works at every ZeRO stage (stage 3 gathers the region's
    units again for the recompute).

    Example::

        for block in self.blocks:
            x = zeroshard.checkpointing.checkpoint(block, x)
    """
    return _checkpoint(function, args, kwargs, reentrant=True)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`checkpoint` on torch's non-reentrant implementation (saved-tensor hooks): gradients
    reach the region's parameters even when no input requires grad, and backward may stop
    recomputing early."""
    return _checkpoint(function, args, kwargs, reentrant=False)


def configure_from_config(cfg: Any) -> None:
    """Apply a Config's `activation_checkpointing` block when the file set any of its keys
    (initialize() calls this; a script's own `configure()` call is kept otherwise)."""
    if any(key.startswith("activation_checkpointing.") for key in cfg.sources):
        configure(None, deepspeed_config=cfg)
