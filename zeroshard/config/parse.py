"""Raw ds_config dict -> a flat draft of typed values keyed by dotted path.

The only reader of raw keys: rejects unknown keys at every depth (with near matches), maps
legacy aliases, explains removed keys, records "auto" for later resolution, looks up optimizer
and scheduler types. Imports nothing of zeroshard but `errors` and `config`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from zeroshard.config.fields import (
    AUTO,
    close_matches,
    coerce,
    default_of,
    hints,
    is_section,
    json_fields,
    show,
    unknown_key,
)
from zeroshard.config.schema_optim import OPTIMIZER_PARAMS, SCHEDULER_PARAMS
from zeroshard.config.schema_zero import ZeroConfig
from zeroshard.config.support import UNMODELLED, UNSUPPORTED_OPTIMIZERS, not_supported
from zeroshard.errors import ConfigError, NotSupportedError

ALIASES: dict[str, str] = {
    "bfloat16": "bf16",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "tensor_parallel.tp": "tensor_parallel.tensor_parallel",
    "tensor_parallel.kernel_inject": "tensor_parallel.replace_with_kernel_inject",
    # DeepSpeed's ZeRO config model names these fields without the stage3_ prefix (the prefixed
    # key is the pydantic alias) and populates by either name, so a ds_config may use both.
    **{f"zero_optimization.{short}": f"zero_optimization.stage3_{short}" for short in (
        "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
        "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
        "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential")},
}
"""Legacy or alternative dotted key -> current dotted key (same parent section)."""

REMOVED: dict[str, str] = {
    "gradient_accumulation_dtype": 'not a ds_config key; use "data_types": {"grad_accum_dtype": "fp32"}.',
}
"""Keys users invent, with the spelling to use instead."""

CLIENT_IGNORED: dict[str, str] = {
    "comms_config": "LLaMA-Factory's examples/deepspeed/*.json write it; no DeepSpeed 0.19.8 key reads it "
                    "(the comms logger is \"comms_logger\")",
    "monitor_config": "LLaMA-Factory's examples/deepspeed/*.json write it; no DeepSpeed 0.19.8 key reads it "
                      "(the monitors are \"tensorboard\", \"csv_monitor\", \"wandb\", \"comet\")",
    "fp8.loss_scale_window": "LLaMA-Factory's ds_z3_fp8_config.json copies fp16's loss-scaler keys into \"fp8\", a "
                             "section DeepSpeed ignores whole; zeroshard's fp8 section (its extension) acts on "
                             "\"enabled\", and its float8 scales come from each tensor's amax: nothing is loss-scaled",
    "fp8.hysteresis": "as fp8.loss_scale_window",
    "fp8.min_loss_scale": "as fp8.loss_scale_window",
}
"""Keys a listed client (docs/clients.md) writes that DeepSpeed 0.19.8 ignores (it reads no such
key, or no such section): accepted with one start-up note that they do nothing, never refused
(issue 39's rule: a config DeepSpeed accepts and a real client writes loads). A misspelling of a
real key is still refused with "did you mean"."""

DEPRECATED_BOOLS: dict[str, tuple[tuple[str, ...], str]] = {
    "zero_optimization.cpu_offload": (("zero_optimization.offload_optimizer.device",),
                                      '"offload_optimizer": {"device": "cpu"}'),
    "zero_optimization.cpu_offload_param": (("zero_optimization.offload_param.device",),
                                            '"offload_param": {"device": "cpu"}'),
    "zero_optimization.cpu_offload_use_pin_memory": (
        ("zero_optimization.offload_optimizer.pin_memory", "zero_optimization.offload_param.pin_memory"),
        '"pin_memory" inside "offload_optimizer" / "offload_param"'),
}
"""DeepSpeed's deprecated boolean offload keys, mapped as DeepSpeed maps them: dotted key ->
(the keys it sets, the spelling to use). true selects "cpu" (or pins); false leaves the defaults."""


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """How to check the value of one dotted key."""

    tp: Any
    meta: Mapping[str, Any]
    default: Any


@dataclass(slots=True)
class Draft:
    """The file's content, flattened: dotted key -> typed value, plus what is left to resolve."""

    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    autos: dict[str, FieldSpec] = field(default_factory=dict)
    unmodelled: dict[str, Any] = field(default_factory=dict)
    pending: list[NotSupportedError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    optimizer: tuple[str, type | dict[str, FieldSpec]] | None = None
    scheduler: tuple[str, type | dict[str, FieldSpec]] | None = None

    def set(self, path: str, value: Any, source: str) -> None:
        self.values[path] = value
        self.sources[path] = source
        self.autos.pop(path, None)


def _mapping(raw: Any, path: str, what: str) -> Mapping[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: got {show(raw)}, expected an object ({what}).")
    for key in raw:
        if not isinstance(key, str):
            raise ConfigError(f"{path}: key {key!r} is not a string.")
    return raw


def _parent(path: str) -> str:
    """"a.b.c" -> "a.b." and "a" -> "" (the prefix form parse_section uses)."""
    head = path.rpartition(".")[0]
    return head + "." if head else ""


def _non_finite(value: Any, path: str) -> tuple[str, float] | None:
    """The first inf/nan number inside `value` (nested lists and objects), with its path."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    if isinstance(value, Mapping):
        items: Any = ((f"{path}.{k}", v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for sub, v in items:
        found = _non_finite(v, sub)
        if found:
            return found
    return None


def _leaf(draft: Draft, path: str, spec: FieldSpec, value: Any) -> None:
    found = _non_finite(value, path)
    if found and not (spec.meta.get("inf_is_none") and value == math.inf):
        where, number = found
        raise ConfigError(f"{where}: got {show(number)}, expected a finite number (JSON's Infinity and NaN "
                          "are not values a run can use).")
    if isinstance(value, str) and value == AUTO and spec.tp is not str:
        draft.autos[path] = spec
        draft.sources[path] = "auto (unresolved)"
        return
    draft.set(path, coerce(value, spec.tp, path, spec.meta, spec.default), "file")


def parse_section(draft: Draft, cls: type, raw: Any, prefix: str) -> None:
    """Check `raw` against schema class `cls` and record its leaves under dotted `prefix`."""
    where = prefix.rstrip(".") or "config"
    raw = _mapping(raw, where, cls.__doc__.splitlines()[0] if cls.__doc__ else cls.__name__)
    fields = {f.name: f for f in json_fields(cls)}
    types = hints(cls)
    legacy = [old.rpartition(".")[2] for old in ALIASES if _parent(old) == prefix]
    deferred: list[tuple[str, Any]] = []
    dotted: list[tuple[str, Any]] = []
    for key, value in raw.items():
        path = prefix + key
        if path in REMOVED:
            raise ConfigError(f"{path}: {REMOVED[path]}")
        if path in DEPRECATED_BOOLS:
            deferred.append((path, value))  # after the section, so the order of keys does not matter
            continue
        if prefix == "" and "." in key:
            dotted.append((key, value))  # after the sections they name: the dotted key wins
            continue
        if path in ALIASES:
            current = ALIASES[path]
            name = current.rpartition(".")[2]
            if name in raw:
                raise ConfigError(f"{path} and {current} are two spellings of one key; keep only {current}.")
            key, path = name, current
        if path in UNMODELLED:
            draft.unmodelled[path] = value
            continue
        if path in CLIENT_IGNORED:
            draft.notes.append(f"{path}: no effect, as in DeepSpeed 0.19.8 ({CLIENT_IGNORED[path]}); remove it.")
            continue
        if prefix == "" and key in _TOP_SPECIAL:
            _TOP_SPECIAL[key](draft, value)
            continue
        if key not in fields:
            raise unknown_key(path, key, [*fields, *legacy])
        tp = types[key]
        if is_section(tp):
            parse_section(draft, tp, value, path + ".")
        else:
            _leaf(draft, path, FieldSpec(tp, fields[key].metadata, default_of(fields[key])), value)
    for path, value in deferred:
        _deprecated_bool(draft, path, value)
    if dotted:
        _read_dotted(draft, cls, dotted, [*fields, *legacy])


def _deprecated_bool(draft: Draft, path: str, value: Any) -> None:
    """Map a deprecated boolean offload key as DeepSpeed does, with a deprecation note."""
    targets, spelling = DEPRECATED_BOOLS[path]
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: got {show(value)}, expected true or false (deprecated: use {spelling}).")
    draft.notes.append(f"{path} is deprecated (DeepSpeed too); read as {spelling}"
                       f"{'' if value else ' left at its default'}. Use that spelling.")
    if not value:
        return
    for target in targets:
        if target in draft.values and draft.sources.get(target) == "file":
            raise ConfigError(f"{path} and {target} are both given; keep only {target} ({spelling}).")
        draft.set(target, True if target.endswith("pin_memory") else "cpu", f"file ({path.rpartition('.')[2]})")


def _dotted_target(key: str, root: type, top_keys: list[str]) -> tuple[str, Any, FieldSpec | None]:
    """The canonical path a dotted top-level key names, its schema type, and its spec (None for a
    section).

    Raises:
        ConfigError: the path is not a key of the schema: the unknown-key error a misspelt key
            gets (at the top level, or inside the section where the path leaves the schema).
    """
    path = ALIASES.get(key, key)
    names = path.split(".")
    cls = root
    for depth, name in enumerate(names):
        fields = {f.name: f for f in json_fields(cls)}
        if name not in fields:
            raise unknown_key(key, key, top_keys) if depth == 0 else unknown_key(key, name, fields)
        tp = hints(cls)[name]
        if depth == len(names) - 1:
            return path, tp, None if is_section(tp) else FieldSpec(tp, fields[name].metadata, default_of(fields[name]))
        if not is_section(tp):  # optimizer / scheduler (typed by their "type") or a value
            raise unknown_key(key, key, top_keys) if depth == 0 else ConfigError(
                f"{key}: unknown key; {'.'.join(names[:depth + 1])} takes a value, not keys.")
        cls = tp
    raise AssertionError("unreachable: a dotted key has at least two names")


def _as_meant(value: Any, tp: Any) -> Any:
    """A computed size for an integer key (TRL writes 0.9 * hidden_size**2) as the integer the
    client meant, truncated as Accelerate's int(...) does for the same key; others unchanged."""
    kinds = typing.get_args(tp) or (tp,)
    if int in kinds and float not in kinds and isinstance(value, float) and math.isfinite(value):
        return int(value)
    return value


def _read_dotted(draft: Draft, root: type, items: list[tuple[str, Any]], top_keys: list[str]) -> None:
    """Top-level keys named by dotted paths ("zero_optimization.reduce_bucket_size": TRL's
    reference-model overrides), read as the keys they name, over a value given in the section.
    DeepSpeed drops them silently; the client meant the nested key. One note names them all."""
    read: list[str] = []
    for key, value in items:
        path, tp, spec = _dotted_target(key, root, top_keys)
        if spec is None:
            parse_section(draft, tp, value, path + ".")
            read.append(path)
            continue
        before = draft.values.get(path) if draft.sources.get(path) == "file" else None
        meant = _as_meant(value, spec.tp)
        _leaf(draft, path, spec, meant)
        if path in draft.autos:  # "auto": resolved later, like the nested key
            read.append(path)
            continue
        draft.sources[path] = f"file (top-level {key!r})"
        was = f", over {show(before)} in the section" if before is not None and before != draft.values[path] else ""
        cut = f" (from {show(value)})" if meant != value else ""
        read.append(f"{path} = {show(draft.values[path])}{cut}{was}")
    draft.notes.append(f"dotted top-level keys read as the keys they name (DeepSpeed ignores them): "
                       f"{'; '.join(read)}. Write them inside their sections.")


def parse_zero(draft: Draft, raw: Any) -> None:
    """`zero_optimization`, which older DeepSpeed tutorials give as a bare boolean (true = stage 1)."""
    if isinstance(raw, bool):
        zero_stage = 1 if raw else 0
        draft.notes.append(f'"zero_optimization": {show(raw)} is DeepSpeed\'s old format, read as stage '
                           f'{zero_stage}; write "zero_optimization": {{"stage": {zero_stage}}}.')
        draft.set("zero_optimization.stage", zero_stage, "file (zero_optimization: " + show(raw) + ")")
        return
    parse_section(draft, ZeroConfig, raw, "zero_optimization.")


# --- optimizer and scheduler -----------------------------------------------------------------


def _torch_classes(module: Any, base: type) -> dict[str, type]:
    return {
        name.lower(): obj for name, obj in vars(module).items()
        if inspect.isclass(obj) and issubclass(obj, base) and obj is not base and not name.startswith("_")
    }


def _signature_specs(cls: type, skip: tuple[str, ...]) -> dict[str, FieldSpec] | None:
    """Keyword parameters of `cls` as specs; None when it takes **kwargs (anything goes)."""
    specs: dict[str, FieldSpec] = {}
    for name, p in inspect.signature(cls).parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if name in skip or p.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        default = dataclasses.MISSING if p.default is inspect.Parameter.empty else p.default
        specs[name] = FieldSpec(Any, {}, default)
    return specs


def _check_torch_value(path: str, value: Any, spec: FieldSpec) -> None:
    default = spec.default
    if isinstance(default, bool) and not isinstance(value, bool):
        raise ConfigError(f"{path}: got {show(value)}, expected true or false. Default: {show(default)}.")
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: got {show(value)}, expected a number. Default: {show(default)}.")
    name = path.rpartition(".")[2]
    if name in ("lr", "eps", "weight_decay") and isinstance(value, (int, float)) and value < 0:
        raise ConfigError(f"{path}: got {show(value)}, expected a number >= 0. Default: {show(default)}.")


def _parse_params(draft: Draft, kind: type | dict[str, FieldSpec] | None, raw: Any, path: str,
                  owner: str) -> None:
    if isinstance(kind, type):
        parse_section(draft, kind, raw, path + ".")
        return
    raw = _mapping(raw, path, f"keyword arguments of {owner}")
    for key, value in raw.items():
        sub = f"{path}.{key}"
        if kind is None:  # the class takes **kwargs
            spec = FieldSpec(Any, {}, dataclasses.MISSING)
        elif key not in kind:
            hint = close_matches(key, kind) or f" {owner} accepts: {', '.join(kind)}."
            raise ConfigError(f"{sub}: unknown parameter of {owner}.{hint}")
        else:
            spec = kind[key]
        _leaf(draft, sub, spec, value)
        if sub in draft.values:
            _check_torch_value(sub, draft.values[sub], spec)


def _section_keys(raw: Mapping[str, Any], path: str, allowed: tuple[str, ...]) -> None:
    table = OPTIMIZER_PARAMS if path == "optimizer" else SCHEDULER_PARAMS
    param_names = {f.name for _, cls in table.values() for f in dataclasses.fields(cls)}
    for key in raw:
        if key in param_names:
            raise ConfigError(f'{path}.{key}: unknown key; {key} is a parameter of the {path}: move it into "params".')
        if key not in allowed:
            raise unknown_key(f"{path}.{key}", key, allowed)
    if "type" not in raw:
        raise ConfigError(f'{path}.type: required; name the {path}, e.g. "type": '
                          f'"{"AdamW" if path == "optimizer" else "WarmupLR"}".')
    if not isinstance(raw["type"], str):
        raise ConfigError(f"{path}.type: got {show(raw['type'])}, expected a string.")


def parse_optimizer(draft: Draft, raw: Any) -> None:
    """`optimizer`: {"type": ..., "params": {...}}; params are checked against the type."""
    if raw is None:
        return
    raw = _mapping(raw, "optimizer", 'e.g. {"type": "AdamW", "params": {"lr": 1e-4}}')
    _section_keys(raw, "optimizer", ("type", "params", "legacy_fusion"))
    name = raw["type"]
    lower = name.lower()
    torch_classes = _torch_classes(torch.optim, torch.optim.Optimizer)
    kind: type | dict[str, FieldSpec] | None
    if lower in OPTIMIZER_PARAMS:
        canonical, kind = OPTIMIZER_PARAMS[lower]
    elif lower in UNSUPPORTED_OPTIMIZERS:
        draft.pending.append(not_supported(
            "optimizer.type", name, f"DeepSpeed's {UNSUPPORTED_OPTIMIZERS[lower]} optimizer is not provided.",
            'Use "Adam", "AdamW", "Lamb" or a torch.optim optimizer.'))
        return
    elif lower in torch_classes:
        cls = torch_classes[lower]
        canonical, kind = cls.__name__, _signature_specs(cls, ("self", "params"))
    else:
        others = sorted(c.__name__ for k, c in torch_classes.items()
                        if k not in OPTIMIZER_PARAMS and k not in UNSUPPORTED_OPTIMIZERS)
        hint = close_matches(name, ["Adam", "AdamW", "Lamb", *others])
        raise ConfigError(f"optimizer.type: unknown optimizer {show(name)}.{hint} Known: Adam, AdamW, Lamb, "
                          f"or a torch.optim class: {', '.join(others)}.")
    draft.optimizer = (canonical, kind if kind is not None else {})
    draft.set("optimizer.type", canonical, "file")
    if "legacy_fusion" in raw:
        _leaf(draft, "optimizer.legacy_fusion", FieldSpec(bool, {}, False), raw["legacy_fusion"])
    _parse_params(draft, kind, raw.get("params"), "optimizer.params", canonical)


def parse_scheduler(draft: Draft, raw: Any) -> None:
    """`scheduler`: a DeepSpeed schedule or a torch.optim.lr_scheduler class, with params."""
    if raw is None:
        return
    raw = _mapping(raw, "scheduler", 'e.g. {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}')
    _section_keys(raw, "scheduler", ("type", "params"))
    name = raw["type"]
    lower = name.lower()
    torch_classes = _torch_classes(torch.optim.lr_scheduler, torch.optim.lr_scheduler.LRScheduler)
    torch_classes["reducelronplateau"] = torch.optim.lr_scheduler.ReduceLROnPlateau
    kind: type | dict[str, FieldSpec] | None
    if lower in SCHEDULER_PARAMS:
        canonical, kind = SCHEDULER_PARAMS[lower]
    elif lower in torch_classes:
        cls = torch_classes[lower]
        canonical, kind = cls.__name__, _signature_specs(cls, ("self", "optimizer"))
    else:
        known = [c for c, _ in SCHEDULER_PARAMS.values()] + [c.__name__ for c in torch_classes.values()]
        hint = close_matches(name, known) or ""
        raise ConfigError(f"scheduler.type: unknown scheduler {show(name)}.{hint} Known: "
                          f"{', '.join(known[:5])}, or a torch.optim.lr_scheduler class.")
    draft.scheduler = (canonical, kind if kind is not None else {})
    draft.set("scheduler.type", canonical, "file")
    _parse_params(draft, kind, raw.get("params"), "scheduler.params", canonical)


_TOP_SPECIAL = {"optimizer": parse_optimizer, "scheduler": parse_scheduler, "zero_optimization": parse_zero}
"""Top-level sections that need more than the generic walk."""


def parse_document(raw: Mapping[str, Any], config_cls: type) -> Draft:
    """Walk the whole file; return the draft (autos unresolved, batch triad unsolved)."""
    draft = Draft()
    parse_section(draft, config_cls, raw, "")
    return draft
