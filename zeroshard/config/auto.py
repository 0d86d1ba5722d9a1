"""Resolve "auto" values (HF Transformers / Accelerate style) in a parsed draft.

Order, per key: `auto_values[dotted_key]` from initialize(); then the model rule when the hidden
size is known; then the key's own rule ("feature off" for enable flags, the optimizer's lr for
warmup_max_lr); then, inside the sections DeepSpeed 0.19.8 reads through its pydantic models
(`DEEPSPEED_DROPS_AUTO`), the key's default with a start-up note, because DeepSpeed drops an
"auto" there and uses its default (a config passed straight to `deepspeed.initialize` by a
client such as OpenRLHF keeps Transformers' "auto"s); otherwise an error saying what could
resolve it. The batch triad's "auto"s are left to `batch.py`. Imports nothing of zeroshard but `errors` and `config`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from zeroshard.config.batch import GAS, MICRO, TBS
from zeroshard.config.fields import coerce
from zeroshard.config.parse import Draft
from zeroshard.errors import ConfigError

FROM_ARGS = "auto (from initialize arguments)"
BATCH_KEYS = (TBS, MICRO, GAS)

HIDDEN_SIZE_RULES: dict[str, Callable[[int], int]] = {
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
}
"""Keys sized from the model's hidden size h, as HF Transformers does (h*h, 0.9*h*h, 10*h)."""

OFF_RULES: dict[str, tuple[Any, str]] = {
    "fp16.enabled": (False, "auto (off: initialize() did not enable it)"),
    "bf16.enabled": (False, "auto (off: initialize() did not enable it)"),
    "zero_optimization.offload_optimizer.device": ("none", "auto (none: initialize() set no device)"),
    "zero_optimization.offload_param.device": ("none", "auto (none: initialize() set no device)"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        False, "auto (off: initialize() did not enable it)"),
    "scheduler.params.warmup_min_lr": (0.0, "auto (0, as HF Trainer sets it)"),
    "data_types.keep_in_fp32_modules": (None, "auto (the model's own Transformers fp32 lists)"),
    # DeepSpeed's own "auto" values, kept as such: config/zenflow_checks.py::check_zenflow refuses them by name
    "zero_optimization.zenflow.select_interval": ("auto", "file (\"auto\": DeepSpeed's epoch rule)"),
    "zero_optimization.zenflow.update_interval": ("auto", "file (\"auto\": DeepSpeed's adaptive rule)"),
}
"""Keys whose "auto" means "off / zero" unless initialize() supplies a value."""

HINTS: dict[str, str] = {
    "zero_optimization.stage": "set it to 0, 1, 2 or 3",
    "gradient_clipping": "set it to a maximum gradient norm (e.g. 1.0), or 0 for no clipping",
    "optimizer.params.lr": "set it to a number (e.g. 1e-4), or pass the script's optimizer to initialize()",
    "scheduler.params.warmup_max_lr": "set optimizer.params.lr, or set warmup_max_lr to a number, e.g. 0.001",
    "scheduler.params.warmup_num_steps": "set it to a number of optimizer steps, e.g. 1000",
    "scheduler.params.total_num_steps": "set it to the number of optimizer steps in the run, e.g. 10000",
}
"""What to tell the user when an "auto" cannot be resolved (default: set it to a value)."""

DEEPSPEED_DROPS_AUTO = ("zero_optimization.", "bf16.", "fp16.", "tensor_parallel.", "hybrid_engine.", "compile.",
                        "comms_logger.", "tensorboard.", "wandb.", "csv_monitor.", "comet.", "timers.")
"""Sections DeepSpeed 0.19.8 parses with its `DeepSpeedConfigModel`, whose constructor drops every
"auto" value (runtime/config_utils.py), so the key takes its default there. Keys elsewhere
(`gradient_clipping`, `optimizer.params.*`, `scheduler.params.*`) reach DeepSpeed's code as the
string and fail later; zeroshard refuses those at load with what would resolve them."""

KEEP_REFUSING = frozenset({"zero_optimization.stage"})
"""Keys of those sections still refused when "auto" is left: DeepSpeed would silently train at
stage 0 (no partitioning, the most memory), which a config asking for "auto" never meant; the
launcher that writes it (Accelerate) always fills it (docs/deepspeed-differences.md)."""


def _from_args(draft: Draft, path: str, value: Any) -> None:
    spec = draft.autos[path]
    try:
        typed = coerce(value, spec.tp, path, spec.meta, spec.default)
    except ConfigError as err:
        raise ConfigError(f"{err} (the value initialize() supplied for \"auto\")") from None
    draft.set(path, typed, FROM_ARGS)


def _optimizer_lr(draft: Draft, auto_values: Mapping[str, Any]) -> Any:
    if "optimizer.params.lr" in draft.values:
        return draft.values["optimizer.params.lr"]
    return auto_values.get("optimizer.params.lr")


def resolve_autos(draft: Draft, *, hidden_size: int | None, auto_values: Mapping[str, Any]) -> list[str]:
    """Replace every "auto" in `draft` by a value, recording its source.

    Returns:
        The batch-triad keys still "auto" (batch.py derives them from the others).

    Raises:
        ConfigError: an "auto" nothing can resolve, naming what would.
    """
    for path in list(draft.autos):
        if path in auto_values:
            _from_args(draft, path, auto_values[path])
    batch_autos = [k for k in BATCH_KEYS if k in draft.autos]
    for key in batch_autos:
        draft.autos.pop(key)
    for path in list(draft.autos):
        if path in HIDDEN_SIZE_RULES and hidden_size is not None:
            draft.set(path, HIDDEN_SIZE_RULES[path](hidden_size), f"auto (model hidden_size={hidden_size})")
        elif path in OFF_RULES:
            value, source = OFF_RULES[path]
            draft.set(path, value, source)
        elif path == "scheduler.params.warmup_max_lr" and _optimizer_lr(draft, auto_values) is not None:
            _from_args(draft, path, _optimizer_lr(draft, auto_values))
            draft.sources[path] = "auto (optimizer.params.lr)"
    for path in [p for p in draft.autos if p.startswith(DEEPSPEED_DROPS_AUTO) and p not in KEEP_REFUSING]:
        default = draft.autos[path].default
        draft.set(path, default, "auto (the default: nothing supplied a value, DeepSpeed drops the \"auto\")")
        draft.notes.append(f'{path}: "auto" and neither initialize() nor the model supplied a value; using the '
                           f"default {default!r}, as DeepSpeed 0.19.8 does (it drops \"auto\" in this section).")
    for path in draft.autos:
        hint = HINTS.get(path, "set it to a value (see docs/config.md)")
        raise ConfigError(f'{path}: is "auto" but initialize() supplied no value for it; {hint}.')
    return batch_autos
