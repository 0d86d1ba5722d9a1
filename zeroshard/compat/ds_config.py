"""DeepSpeed's config classes (`DeepSpeedConfig`, `DeepSpeedZeroConfig`, `DeepSpeedFP16Config`, ...)
as pydantic models whose values come from zeroshard's own config reader.

DeepSpeed exposes its config as pydantic models; code (its own tests, libraries) builds them
from a dict and reads attributes. Here every section model runs zeroshard's section parser
(`config.load.load_section`: the same key, type, range and alias checks as a ds_config file)
and shows the result under DeepSpeed's field names; a zeroshard ConfigError becomes pydantic's
`ValidationError` (its message is zeroshard's). `DeepSpeedConfig` wraps zeroshard's whole
`Config` (`load_config`). pydantic is imported here only: the alias imports this module on
first use of one of these names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from zeroshard.config import BF16Config, Config, FP16Config, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from zeroshard.config.batch import solve_batch
from zeroshard.config.fields import json_fields
from zeroshard.config.load import load_config, load_section, read_config_file
from zeroshard.config.schema_zero import LeafModuleConfig
from zeroshard.errors import ConfigError


class DeepSpeedConfigModel(BaseModel):
    """DeepSpeed's base of config models: unknown keys refused, fields settable by name or alias,
    and deprecated fields (`Field(..., json_schema_extra={"deprecated": True, "new_param": "x",
    "new_param_fn": f})`) moved onto their replacement; giving both is an AssertionError, as in
    DeepSpeed. `"auto"` values are dropped (left to their defaults) unless `strict=True`."""

    model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                              populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:
            data = {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto")}
        super().__init__(**data)
        for name, info in type(self).model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated") and name in self.model_fields_set:
                self._move_deprecated(name, extra)

    def _move_deprecated(self, name: str, extra: Mapping[str, Any]) -> None:
        new = str(extra.get("new_param") or "")
        if not new or not extra.get("set_new_param", True):
            return
        convert: Callable[[Any], Any] = extra.get("new_param_fn") or (lambda v: v)  # type: ignore[assignment]
        *path, leaf = new.split(".")
        target: Any = self
        for part in path:
            target = getattr(target, part)
        assert leaf not in target.model_fields_set, (
            f"{name} is deprecated and replaced by {new}; give only {new}, not both")
        setattr(target, leaf, convert(getattr(self, name)))


def _value_error(err: ConfigError) -> ValueError:
    return ValueError(str(err))


class _ZeroshardSection(DeepSpeedConfigModel):
    """A DeepSpeed section model over a zeroshard schema class: the input is parsed by zeroshard
    (`_zs_prefix` names the section in messages and selects its legacy aliases); DeepSpeed field
    names that differ from zeroshard's are listed in `_ds_names` (DeepSpeed name -> zeroshard's)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, validate_assignment=False,
                              arbitrary_types_allowed=True, protected_namespaces=())
    _zs_cls: ClassVar[type]
    _zs_prefix: ClassVar[str]
    _ds_names: ClassVar[dict[str, str]] = {}
    _sections: ClassVar[dict[str, type[_ZeroshardSection]]] = {}
    """Nested sections: zeroshard field -> model; None unless given (DeepSpeed's Optional), but
    for those in `_always` (DeepSpeed's `default_factory` sections)."""
    _always: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _parse_with_zeroshard(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.__name__}: expected a mapping of {cls._zs_prefix.rstrip('.')} keys, got {data!r}")
        zs_of = {**cls._ds_names, **{zs: zs for zs in cls._ds_names.values()}}
        raw = {zs_of.get(k, k): v for k, v in data.items() if not (k in cls._sections and v is None)}
        try:
            parsed = load_section(cls._zs_cls, raw, cls._zs_prefix)
        except ConfigError as e:
            raise _value_error(e) from None
        ds_of = {zs: ds for ds, zs in cls._ds_names.items()}
        out: dict[str, Any] = {}
        for f in json_fields(cls._zs_cls):
            value = getattr(parsed, f.name)
            if f.name in cls._sections:
                untouched = raw.get(f.name) is None and value == type(value)()  # e.g. set by cpu_offload
                value = None if untouched and f.name not in cls._always else cls._sections[f.name].model_validate(
                    {g.name: getattr(value, g.name) for g in json_fields(type(value))})
            elif isinstance(value, tuple):
                value = list(value)  # DeepSpeed's models hold lists
            out[ds_of.get(f.name, f.name)] = value
        return out

    def zeroshard(self) -> Any:
        """The zeroshard schema object these values came from (sections as zeroshard builds them)."""
        kwargs: dict[str, Any] = {}
        for f in json_fields(self._zs_cls):
            value = getattr(self, {zs: ds for ds, zs in self._ds_names.items()}.get(f.name, f.name))
            kwargs[f.name] = value.zeroshard() if isinstance(value, _ZeroshardSection) else (
                tuple(value) if isinstance(value, list) else value)
        return self._zs_cls(**{k: v for k, v in kwargs.items() if v is not None})


class DeepSpeedFP16Config(_ZeroshardSection):
    """`fp16`, read by zeroshard: `min_loss_scale` is checked only when the scale is dynamic, as in
    DeepSpeed, and so is `loss_scale_window`."""

    _zs_cls = FP16Config
    _zs_prefix = "fp16."


class DeepSpeedBF16Config(_ZeroshardSection):
    """`bf16` (`bfloat16`), read by zeroshard."""

    _zs_cls = BF16Config
    _zs_prefix = "bf16."


class DeepSpeedZeroOffloadParamConfig(_ZeroshardSection):
    """`zero_optimization.offload_param`, read by zeroshard."""

    _zs_cls = OffloadParamConfig
    _zs_prefix = "zero_optimization.offload_param."


class DeepSpeedZeroOffloadOptimizerConfig(_ZeroshardSection):
    """`zero_optimization.offload_optimizer`, read by zeroshard; `pipeline` is DeepSpeed's
    "read or write pipelined"."""

    _zs_cls = OffloadOptimizerConfig
    _zs_prefix = "zero_optimization.offload_optimizer."

    @property
    def pipeline(self) -> bool:
        values = self.model_dump()
        return bool(values["pipeline_read"] or values["pipeline_write"])


class DeepSpeedZeroLeafModuleConfig(_ZeroshardSection):
    """`zero_optimization.leaf_module` {classes, names, name_suffixes}, read by zeroshard (a single
    string reads as a one-item list, as in DeepSpeed)."""

    _zs_cls = LeafModuleConfig
    _zs_prefix = "zero_optimization.leaf_module."


_ZERO_STAGE3_SHORT = ("prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
                 "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
                 "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential")


class DeepSpeedZeroConfig(_ZeroshardSection):
    """`zero_optimization`, read by zeroshard. DeepSpeed's short names of the `stage3_*` keys
    (`prefetch_bucket_size`, ...) are the attribute names; `offload_param` / `offload_optimizer`
    are None unless given, as in DeepSpeed."""

    _zs_cls = ZeroConfig
    _zs_prefix = "zero_optimization."
    _ds_names = {short: f"stage3_{short}" for short in _ZERO_STAGE3_SHORT}
    _sections = {"offload_param": DeepSpeedZeroOffloadParamConfig,
                 "offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig,
                 "leaf_module": DeepSpeedZeroLeafModuleConfig}
    _always = frozenset({"leaf_module"})


def get_bfloat16_config(param_dict: Mapping[str, Any]) -> DeepSpeedBF16Config:
    """The `bf16` (or legacy `bfloat16`) section of a ds_config dict as a model."""
    section = param_dict.get("bf16", param_dict.get("bfloat16", {}))
    return DeepSpeedBF16Config(**(section or {}))


def get_gradient_clipping(param_dict: Mapping[str, Any]) -> float:
    """`gradient_clipping` of a ds_config dict, with DeepSpeed's default (1.0)."""
    default = next(f.default for f in dataclasses.fields(Config) if f.name == "gradient_clipping")
    return float(param_dict.get("gradient_clipping", default))


def _as_dict(params: Any) -> dict[str, Any]:
    """An optimizer's / scheduler's params (a schema dataclass or a mapping) as a plain dict."""
    if dataclasses.is_dataclass(params):
        return {f.name: getattr(params, f.name) for f in json_fields(type(params))}
    return dict(params)


def _dp_world_size() -> int:
    from zeroshard.comm import get_world_size

    return get_world_size()


class DeepSpeedConfig:
    """DeepSpeed's whole-config object over zeroshard's `Config`.

    Args:
        config: a path to a JSON/hjson file or a dict.
        mpu, mesh_device: accepted for DeepSpeed's signature; the data-parallel size is the
            process group's world size.

    Attributes are zeroshard's `Config` fields (DeepSpeed's key names), plus DeepSpeed's derived
    names (`zero_config`, `zero_enabled`, `zero_optimization_stage`, `fp16_enabled`,
    `bfloat16_enabled`, `optimizer_name`, `optimizer_params`, `scheduler_name`,
    `scheduler_params`, `_param_dict`). Raises ConfigError (a ValueError) as `initialize` would.
    """

    def __init__(self, config: str | Path | Mapping[str, Any], mpu: Any = None, mesh_device: Any = None) -> None:
        raw = dict(config) if isinstance(config, Mapping) else read_config_file(config)
        self._param_dict = raw
        self.world_size = _dp_world_size()
        self._config: Config = load_config(raw, dp_world_size=self.world_size)
        cfg = self._config
        self.train_batch_size: int | None = cfg.train_batch_size
        self.train_micro_batch_size_per_gpu: int | None = cfg.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps: int | None = cfg.gradient_accumulation_steps
        zero = raw.get("zero_optimization", {})
        self.zero_config = DeepSpeedZeroConfig(**({"stage": int(zero)} if isinstance(zero, bool) else zero or {}))
        self.zero_optimization_stage = cfg.zero_optimization.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.fp16_enabled = cfg.fp16.enabled
        self.bfloat16_enabled = cfg.bf16.enabled
        self.optimizer_name = cfg.optimizer.type.lower() if cfg.optimizer is not None else None
        self.optimizer_params = _as_dict(cfg.optimizer.params) if cfg.optimizer is not None else None
        self.scheduler_name = cfg.scheduler.type if cfg.scheduler is not None else None
        self.scheduler_params = _as_dict(cfg.scheduler.params) if cfg.scheduler is not None else None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_config":
            raise AttributeError(name)
        try:
            return getattr(self._config, name)
        except AttributeError:
            raise AttributeError(f"DeepSpeedConfig (served by zeroshard) has no attribute {name!r}; the "
                                 "ds_config keys are its attributes (see docs/config.md)") from None

    def _configure_train_batch_size(self) -> None:
        """Solve the batch triad from the three attributes as they are now (None = not given);
        an inconsistent or incomplete triad is an AssertionError, as in DeepSpeed."""
        try:
            solved = solve_batch(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                 self.gradient_accumulation_steps, self.world_size)
        except ConfigError as e:
            raise AssertionError(str(e)) from None
        self.train_batch_size = solved.train_batch_size
        self.train_micro_batch_size_per_gpu = solved.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = solved.gradient_accumulation_steps

    def print(self, name: str = "DeepSpeedConfig") -> None:
        """Every value and where it came from (zeroshard's `Config.describe()`)."""
        print(f"{name}:\n{self._config.describe()}")
