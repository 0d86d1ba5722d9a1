"""`load_config`: a ds_config (path or mapping) -> one validated, frozen `Config`.

Steps, in order: read JSON; walk it against the schema (parse.py: unknown keys, aliases, removed
keys, types, ranges); resolve "auto" (auto.py); solve the batch triad (batch.py); build the
dataclasses; cross-field checks; ZeRO-stage applicability (zero_stages.py); not-supported (support.py).
Imports nothing of zeroshard but `errors` and `config`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zeroshard.config.auto import resolve_autos
from zeroshard.config.batch import GAS, MICRO, TBS, BatchSizes, solve_batch
from zeroshard.config.fields import MAX_SAMPLES, FrozenDict, describe_type, hints, is_section, json_fields, show
from zeroshard.config.parse import Draft, FieldSpec, parse_document, parse_section
from zeroshard.config.schema import CheckpointConfig, Config, FP16Config
from zeroshard.config.schema_ep import check_expert_parallel
from zeroshard.config.schema_fp8 import check_fp8
from zeroshard.config.schema_optim import LambParams, OptimizerConfig, SchedulerConfig
from zeroshard.config.schema_tp import check_tensor_parallel
from zeroshard.config.schema_zero import OffloadOptimizerConfig
from zeroshard.config.support import check_supported
from zeroshard.config.zenflow_checks import check_zenflow, mark_zenflow
from zeroshard.config.zero_stages import check_zero_stages, idle_keys
from zeroshard.errors import ConfigConflictError, ConfigError, NotSupportedError

ConfigSource = str | os.PathLike[str] | Mapping[str, Any]


class _Pairs(dict):  # type: ignore[type-arg]
    """A JSON object that remembers keys given twice (the first and the last value)."""

    duplicates: list[tuple[str, Any, Any]]


def _object_pairs(pairs: list[tuple[str, Any]]) -> _Pairs:
    obj = _Pairs()
    obj.duplicates = []
    for key, value in pairs:
        if key in obj:
            obj.duplicates.append((key, obj[key], value))
        obj[key] = value
    return obj


def _short(value: Any) -> str:
    text = show(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_duplicates(obj: Any, path: str, where: str) -> None:
    """Raise for the first key given twice in one object (JSON says nothing; the last would win)."""
    if isinstance(obj, dict):
        for key, first, last in getattr(obj, "duplicates", ()):
            dotted = f"{path}.{key}" if path else key
            raise ConfigError(f"{where}: {dotted} is given twice ({_short(first)} and then {_short(last)}); "
                              "keep one. (A JSON reader would silently keep the last.)")
        for key, value in obj.items():
            _check_duplicates(value, f"{path}.{key}" if path else key, where)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            _check_duplicates(value, f"{path}[{i}]", where)


def _parse_text(text: str, p: Path) -> Any:
    """JSON first; if that fails, hjson (DeepSpeed reads ds_config files with hjson: comments,
    trailing commas, unquoted keys). Both report keys given twice."""
    try:
        return json.loads(text, object_pairs_hook=_object_pairs)
    except json.JSONDecodeError as err:
        json_err = err
    try:
        import hjson  # DeepSpeed's own config reader; a declared dependency of zeroshard
    except ImportError:  # pragma: no cover - installed with zeroshard
        hjson = None
    if hjson is not None:
        try:
            return hjson.loads(text, object_pairs_hook=_object_pairs)
        except hjson.HjsonDecodeError:
            pass
    raise ConfigError(
        f"{p}:{json_err.lineno}:{json_err.colno}: invalid JSON (and not valid hjson either): {json_err.msg}. "
        "(A missing comma between entries and an unquoted string value are the usual causes.)"
    ) from None


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a ds_config file: JSON (with `Infinity`/`NaN`, checked later per key), or hjson as
    DeepSpeed accepts it. A UTF-8 byte-order mark is skipped.

    Raises:
        ConfigError: missing, unreadable or empty file, invalid JSON/hjson, a key given twice in
            one object, or not a JSON object.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # -sig: Windows editors write a BOM
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found.") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{p}: not UTF-8 text (byte {err.start}); save the config as UTF-8.") from None
    except OSError as err:
        raise ConfigError(f"{p}: cannot read the config file ({err.strerror}).") from None
    if not text.strip():
        what = "0 bytes" if not text else f"{len(text)} characters of whitespace only"
        raise ConfigError(f"{p}: the config file is empty ({what}); write a JSON object into it, at least "
                          '{"train_micro_batch_size_per_gpu": 1} (or pass the config as a dict).')
    raw = _parse_text(text, p)
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a JSON object, got {type(raw).__name__}.")
    _check_duplicates(raw, "", str(p))
    return dict(raw)


def _build(cls: type, prefix: str, draft: Draft, owner: str = "") -> Any:
    """Instantiate schema class `cls` from the draft's values below dotted `prefix`."""
    return cls(**_kwargs(cls, prefix, draft, owner))


def _kwargs(cls: type, prefix: str, draft: Draft, owner: str = "") -> dict[str, Any]:
    """Constructor arguments of `cls` from the draft (absent keys keep their defaults)."""
    kwargs: dict[str, Any] = {}
    types_ = hints(cls)
    for f in json_fields(cls):
        path = prefix + f.name
        if is_section(types_[f.name]):
            kwargs[f.name] = _build(types_[f.name], path + ".", draft, owner)
        elif path in draft.values:
            kwargs[f.name] = draft.values[path]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{path}: required{owner}; add it ({describe_type(types_[f.name], f.metadata)}).")
    return kwargs


def _build_params(kind: type | dict[str, FieldSpec], prefix: str, draft: Draft, owner: str) -> Any:
    if isinstance(kind, type):
        return _build(kind, prefix, draft, f" by {owner}")
    for name, spec in kind.items():
        if spec.default is dataclasses.MISSING and prefix + name not in draft.values:
            raise ConfigError(f"{prefix}{name}: required by {owner}; add it to {prefix.rstrip('.')}.")
    given = {k[len(prefix):]: v for k, v in draft.values.items() if k.startswith(prefix)}
    return FrozenDict(given)


def _build_optimizer(draft: Draft) -> OptimizerConfig | None:
    if draft.optimizer is None:
        return None
    canonical, kind = draft.optimizer
    params = _build_params(kind, "optimizer.params.", draft, canonical)
    return OptimizerConfig(type=canonical, params=params,
                           legacy_fusion=draft.values.get("optimizer.legacy_fusion", False))


def _build_scheduler(draft: Draft) -> SchedulerConfig | None:
    if draft.scheduler is None:
        return None
    canonical, kind = draft.scheduler
    return SchedulerConfig(type=canonical, params=_build_params(kind, "scheduler.params.", draft, canonical))


def _apply_zero_stage_defaults(draft: Draft) -> None:
    """DeepSpeed's stage-dependent default: overlap_comm is on at stage 3, off below."""
    if "zero_optimization.overlap_comm" not in draft.values:
        draft.values["zero_optimization.overlap_comm"] = draft.values.get("zero_optimization.stage", 0) == 3


def check_contiguous_checkpointing(contiguous: bool, partition: bool, number: int | None) -> None:
    """DeepSpeed's rule for `activation_checkpointing.contiguous_memory_optimization`, shared by
    the config and by `zeroshard.checkpointing.configure(...)` keyword arguments."""
    if contiguous and not partition:
        raise ConfigError("activation_checkpointing.contiguous_memory_optimization: needs "
                          "partition_activations true (as in DeepSpeed). Set both, or neither.")
    if contiguous and number is None:
        raise ConfigError("activation_checkpointing.contiguous_memory_optimization: needs "
                          "number_checkpoints (the number of checkpointed layers). Set it.")


def _check_cross_fields(cfg: Config) -> None:
    """Rules that involve more than one key (each names every key involved).

    Everything initialize() would refuse about a config value belongs here (or in the schema),
    so `zeroshard config check` and initialize() give the same verdict.
    """
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError(
            "fp16.enabled and bf16.enabled are both true; choose one: set bf16.enabled to false "
            "for fp16 with loss scaling, or fp16.enabled to false for bf16."
        )
    act = cfg.activation_checkpointing
    check_contiguous_checkpointing(act.contiguous_memory_optimization, act.partition_activations,
                                   act.number_checkpoints)
    check_fp16_scaling(cfg.fp16)
    params = cfg.optimizer.params if cfg.optimizer is not None else None
    if isinstance(params, LambParams) and params.min_coeff > params.max_coeff:
        raise ConfigError(f"optimizer.params.min_coeff: got {show(params.min_coeff)}, expected <= "
                          f"optimizer.params.max_coeff ({show(params.max_coeff)}).")
    zero = cfg.zero_optimization
    for name, offload in (("offload_optimizer", zero.offload_optimizer), ("offload_param", zero.offload_param)):
        if offload.device == "nvme" and offload.nvme_path is None:
            raise ConfigError(
                f'zero_optimization.{name}.nvme_path: required when device is "nvme"; set it to a '
                'directory on the NVMe drive, e.g. "/local_nvme".'
            )
    check_delayed_update(zero.offload_optimizer)
    check_bf16_master(cfg)
    check_tensor_parallel(cfg.tensor_parallel)
    check_expert_parallel(cfg.expert_parallel)
    check_fp8(cfg.fp8, cfg.precision, cfg.zero_optimization)
    check_periodic_save(cfg.checkpoint)
    check_preemption_save(cfg)
    stated = cfg.data_types.param_dtype
    if stated is not None and stated != cfg.precision:
        raise ConfigConflictError(
            f"data_types.param_dtype={stated!r} conflicts with the training precision {cfg.precision!r} that "
            "fp16.enabled / bf16.enabled select (DeepSpeed asserts the same): set the matching enabled flag, or "
            "remove data_types.param_dtype (the flags alone decide it).")
    if not cfg.managed_gradient_accumulation and zero.overlap_comm and zero.stage < 2:
        raise ConfigConflictError(
            f"managed_gradient_accumulation=False supports ZeRO overlap_comm only with ZeRO stage 2 or 3 (as in "
            f"DeepSpeed): at stage {zero.stage} the gradients are reduced in step(), with no backward to overlap; "
            "set zero_optimization.overlap_comm to false, or managed_gradient_accumulation to true.")


def check_preemption_save(cfg: Config) -> None:
    """An explicit `preemption_save: true` needs a directory to save into (its default acts only
    where there is one)."""
    ckpt = cfg.checkpoint
    if ("checkpoint.preemption_save" in cfg.sources and ckpt.preemption_save and ckpt.save_dir is None
            and ckpt.auto_resume_dir is None):
        raise ConfigError("checkpoint.preemption_save: got true, but neither checkpoint.save_dir nor "
                          "checkpoint.auto_resume_dir is set, so there is nowhere to save the emergency checkpoint; "
                          'set checkpoint.save_dir (e.g. "checkpoints"), or remove checkpoint.preemption_save.')


def check_periodic_save(ckpt: CheckpointConfig) -> None:
    """A periodic save needs a directory to save into."""
    for key, value in (("save_interval_steps", ckpt.save_interval_steps),
                       ("save_interval_minutes", ckpt.save_interval_minutes)):
        if value and ckpt.save_dir is None:
            raise ConfigError(f"checkpoint.{key}: got {show(value)}, but checkpoint.save_dir is not set; set "
                              'checkpoint.save_dir to the checkpoint root (e.g. "checkpoints"), or set '
                              f"checkpoint.{key} to 0.")


def check_fp16_scaling(fp16: FP16Config) -> None:
    """The dynamic loss scale's floor and window, checked only where the scale is dynamic (fp16
    on, loss_scale 0), as DeepSpeed does: elsewhere `min_loss_scale` and `loss_scale_window` are
    unused. Also run when the `fp16` section is read alone (`load_section`, DeepSpeed's
    `DeepSpeedFP16Config`)."""
    if fp16.enabled and fp16.dynamic_loss_scale and fp16.loss_scale_window < 1:
        raise ConfigError(
            f"fp16.loss_scale_window: got {show(fp16.loss_scale_window)}, expected an integer >= 1 while the "
            "loss scale is dynamic (fp16.loss_scale 0). Default: 1000."
        )
    if fp16.enabled and fp16.dynamic_loss_scale and not 0 < fp16.min_loss_scale <= fp16.initial_loss_scale:
        raise ConfigError(
            f"fp16.min_loss_scale: got {show(fp16.min_loss_scale)}, expected a number > 0 and <= the initial "
            f"loss scale 2**fp16.initial_scale_power = {fp16.initial_loss_scale:g}. DeepSpeed's default is 1."
        )


def check_delayed_update(section: OffloadOptimizerConfig) -> None:
    """`offload_optimizer.delayed_update` (zeroshard's extension) overlaps a CPU optimizer step;
    `offload_optimizer.ratio` below 1 keeps part of it on the device."""
    if section.ratio < 1.0:
        if section.device == "none":
            raise ConfigError(f"zero_optimization.offload_optimizer.ratio={show(section.ratio)}: it is the share "
                              'of the optimizer offloaded, so it needs offload_optimizer.device "cpu" (got "none"); '
                              "set the device or remove the key.")
        if section.device == "nvme":
            raise NotSupportedError("zero_optimization.offload_optimizer.ratio below 1 with device \"nvme\" is not "
                                    'implemented (partial offload keeps the rest in CPU memory): use device "cpu".')
        if section.delayed_update:
            raise NotSupportedError("zero_optimization.offload_optimizer.ratio below 1 with delayed_update is not "
                                    "implemented (the background step would run device kernels); use one of them.")
    if not section.delayed_update or section.device == "cpu":
        return
    if section.device == "nvme":
        raise NotSupportedError('zero_optimization.offload_optimizer.delayed_update with device "nvme" is not '
                                'implemented (the swapped step runs synchronously): set device to "cpu" or '
                                'delayed_update to false.')
    raise ConfigError('zero_optimization.offload_optimizer.delayed_update: it delays the CPU optimizer step, '
                      'so it needs offload_optimizer.device "cpu" (got "none"); set the device or remove the key.')


def check_bf16_master(cfg: Config) -> None:
    """`bf16.bf16_master_weights_and_grads` / `bf16.bf16_optimizer_states`: what DeepSpeed 0.19.8
    accepts (runtime/config.py, base_optimizer._configure_master_weights), and what zeroshard
    does not build of it.

    DeepSpeed: both need ZeRO stage 1, 2 or 3; optimizer states in bf16 need bf16 master weights;
    bf16 master weights with fp32 optimizer states need optimizer offload to the CPU with
    DeepSpeedCPUAdam (its fp32_optimizer_states). zeroshard steps torch optimizers, whose states
    take the dtype of the (bf16) master, so that last combination is not built.
    """
    bf16, zero = cfg.bf16, cfg.zero_optimization
    if not (bf16.bf16_master_weights_and_grads or bf16.bf16_optimizer_states):
        return
    key = "bf16.bf16_master_weights_and_grads" if bf16.bf16_master_weights_and_grads else "bf16.bf16_optimizer_states"
    if zero.stage not in (1, 2, 3):
        raise ConfigError(f"{key}: needs zero_optimization.stage 1, 2 or 3 (got {zero.stage}), as in DeepSpeed; "
                          "set the stage, or remove the key.")
    if bf16.bf16_optimizer_states and not bf16.bf16_master_weights_and_grads:
        raise ConfigError("bf16.bf16_optimizer_states: needs bf16.bf16_master_weights_and_grads true (as in "
                          "DeepSpeed); set it, or remove bf16_optimizer_states.")
    offloaded = zero.offload_optimizer.device not in (None, "none")
    if not bf16.bf16_optimizer_states:
        if not offloaded:
            raise ConfigError("bf16.bf16_master_weights_and_grads without bf16.bf16_optimizer_states: DeepSpeed "
                              "keeps the optimizer states in fp32 then, which needs offload_optimizer to the CPU "
                              "with DeepSpeedCPUAdam; set bf16.bf16_optimizer_states true to keep them in bf16.")
        raise NotSupportedError("bf16.bf16_master_weights_and_grads without bf16.bf16_optimizer_states: fp32 "
                                "optimizer states beside bf16 master weights (DeepSpeedCPUAdam's "
                                "fp32_optimizer_states) are not implemented; set bf16.bf16_optimizer_states true.")
    if zero.offload_optimizer.device == "nvme":
        raise NotSupportedError("bf16.bf16_master_weights_and_grads with offload_optimizer.device \"nvme\": the "
                                "NVMe swap keeps fp32 masters; offload to \"cpu\", or remove the key.")
    accum = cfg.data_types.grad_accum_dtype
    if accum not in (None, "bf16"):
        raise ConfigError(f"data_types.grad_accum_dtype: got {accum!r}, but bf16.bf16_master_weights_and_grads "
                          "keeps gradients in bf16; set it to \"bf16\" or remove it.")


_ONEBIT = ("onebitadam", "zerooneadam", "onebitlamb")


def check_allreduce_op(cfg: Config, unmodelled: Mapping[str, Any]) -> None:
    """`gradient_allreduce_op: "sum"` where it is not built: ZeRO stage 3, ZenFlow and DeepCompile
    (DeepSpeed refuses these too, in these words), and the 1-bit optimizers (whose compressed
    all-reduce averages). Before the not-supported checks, so the reason named is the pairing."""
    if cfg.gradient_allreduce_op != "sum":
        return
    fix = 'use "mean" (DeepSpeed\'s default), or'
    if cfg.zero_optimization.stage == 3:
        raise ConfigError(f"gradient_allreduce_op='sum' is not supported with ZeRO stage 3 (as in DeepSpeed); {fix} "
                          "ZeRO stage 0, 1 or 2.")
    if cfg.zero_optimization.zenflow.enabled:
        raise ConfigError(f"gradient_allreduce_op='sum' is not supported with ZenFlow (as in DeepSpeed); {fix} "
                          "remove zero_optimization.zenflow.")
    if cfg.compile.deepcompile:
        raise ConfigError(f"gradient_allreduce_op='sum' is not supported with DeepCompile (as in DeepSpeed); {fix} "
                          "remove compile.deepcompile.")
    if cfg.optimizer is not None and cfg.optimizer.type.lower() in _ONEBIT:
        raise NotSupportedError(f"not supported yet: gradient_allreduce_op='sum' with {cfg.optimizer.type}: the "
                                f"1-bit optimizers' compressed all-reduce averages; {fix} another optimizer.")


def load_section(cls: type, raw: Mapping[str, Any], prefix: str) -> Any:
    """Parse and build one schema section alone (e.g. `ZeroConfig` from the object under
    "zero_optimization"), with the same key, type, range and alias checks as `load_config`; the
    whole-config checks (batch triad, stages, cross-field rules) are not run, but the section's
    own rules are (`fp16`: check_fp16_scaling).

    Args:
        cls: the schema class of the section.
        raw: the section's object as the file gives it.
        prefix: its dotted path with a trailing dot ("zero_optimization."), for messages and aliases.

    Raises:
        ConfigError: an unknown key, a wrong type or range, or "auto" (resolved only by initialize()).
    """
    draft = Draft()
    parse_section(draft, cls, raw, prefix)
    if draft.autos:
        raise ConfigError(f"{next(iter(draft.autos))}: \"auto\" is resolved by initialize(), not in a "
                          "section read alone; give a value.")
    if prefix == "zero_optimization.":
        _apply_zero_stage_defaults(draft)
    section = _build(cls, prefix, draft)
    if isinstance(section, FP16Config):
        check_fp16_scaling(section)
    return section


def load_config(
    source: ConfigSource,
    *,
    dp_world_size: int,
    hidden_size: int | None = None,
    auto_values: Mapping[str, Any] | None = None,
    other_batch_world_sizes: tuple[int, ...] = (),
) -> Config:
    """Parse and validate a DeepSpeed ds_config into a frozen `Config`.

    Args:
        source: path to a JSON file, or the config as a mapping (not modified).
        dp_world_size: data-parallel world size, for the batch triad.
        hidden_size: the model's hidden size (`model.config.hidden_size`), for "auto" bucket sizes.
        auto_values: dotted key -> value that initialize() knows (e.g. the script's optimizer lr,
            `{"optimizer.params.lr": 1e-3, "gradient_clipping": 1.0}`); used only where the file
            says "auto".
        other_batch_world_sizes: rank counts the batch triad may also be written for, tried in
            order when it does not hold over `dp_world_size` (AutoTP without an mpu: every rank, as
            DeepSpeed 0.19.8 counts them; comm/parallel_dims.py's `batch_world_sizes`). The count
            that holds becomes `cfg.dp_world_size`.

    Returns:
        The Config; `cfg.describe()` shows every value and where it came from.

    Raises:
        ConfigError: unknown or misspelt key, wrong type or range, unresolvable "auto",
            inconsistent batch sizes, a key that does not apply to the chosen stage.
        NotSupportedError: a valid DeepSpeed value zeroshard does not implement yet.

    Example:
        >>> cfg = load_config({"train_batch_size": 8}, dp_world_size=2)
        >>> cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
        (4, 1)
    """
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise ConfigError(f"dp_world_size: got {show(dp_world_size)}, expected an integer >= 1.")
    if hidden_size is not None and (isinstance(hidden_size, bool) or not isinstance(hidden_size, int)
                                    or hidden_size < 1):
        raise ConfigError(f"hidden_size: got {show(hidden_size)}, expected an integer >= 1 or None.")
    if isinstance(source, Mapping):
        raw: Mapping[str, Any] = source
    elif isinstance(source, (str, os.PathLike)):
        raw = read_config_file(source)
    else:
        raise ConfigError(f"config: got a {type(source).__name__}, expected a path to a JSON file or a dict.")
    draft = parse_document(raw, Config)
    resolve_autos(draft, hidden_size=hidden_size, auto_values=auto_values or {})
    batch, dp_world_size = _solve_batch_over(draft, (dp_world_size, *other_batch_world_sizes))
    for key in (TBS, MICRO, GAS):
        draft.values[key] = getattr(batch, key)
        if key in batch.derived:
            draft.sources[key] = "derived (batch triad)"
            if draft.values[key] > MAX_SAMPLES:
                raise ConfigError(
                    f"{key}: derived as {draft.values[key]} from the other batch sizes, larger than any "
                    f"real run (the bound is {MAX_SAMPLES}); check {TBS}, {MICRO} and {GAS}.")
    _apply_zero_stage_defaults(draft)
    cfg = Config(
        **_kwargs(Config, "", draft),
        dp_world_size=dp_world_size,
        optimizer=_build_optimizer(draft),
        scheduler=_build_scheduler(draft),
        sources=FrozenDict(draft.sources),
    )
    cfg = mark_zenflow(cfg, raw, draft)
    _check_cross_fields(cfg)
    check_allreduce_op(cfg, draft.unmodelled)
    check_zenflow(cfg)
    notes = check_zero_stages(cfg)
    check_supported(cfg, draft.unmodelled, draft.pending, skip=idle_keys(cfg))
    return dataclasses.replace(cfg, notes=(*draft.notes, *notes))


def _solve_batch_over(draft: Draft, counts: tuple[int, ...]) -> tuple[BatchSizes, int]:
    """The batch triad solved over the first rank count it holds for; the first count's error when none."""
    triad = (draft.values.get(TBS), draft.values.get(MICRO), draft.values.get(GAS))
    first: ConfigError | None = None
    for count in counts:
        try:
            return solve_batch(*triad, count), count
        except ConfigError as e:
            first = first or e
    if first is None:
        raise ConfigError("no data-parallel world size to count the batch over")
    raise first


def sequence_parallel_size(raw: Mapping[str, Any]) -> int:
    """The `sequence_parallel_size` a raw ds_config asks for (1 without it), read before
    `load_config` as `tensor_parallel_size` is; `load_config` validates the key again."""
    size = raw.get("sequence_parallel_size", 1) if isinstance(raw, Mapping) else 1
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"sequence_parallel_size: got {show(size)}, expected an integer >= 1 "
                          "(the ranks that share one sample).")
    return size


def tensor_parallel_size(raw: Mapping[str, Any]) -> int:
    """The tensor-parallel size a raw ds_config asks for (1 without the section), read before
    `load_config` so that the data-parallel world size (world / tp) can be given to it; the full
    section is validated by `load_config`."""
    section = raw.get("tensor_parallel") if isinstance(raw, Mapping) else None
    if not isinstance(section, Mapping):
        return 1
    sizes = [section.get("autotp_size", 0)]
    for sub in ("tp", "tensor_parallel"):
        if isinstance(section.get(sub), Mapping):
            sizes.append(section[sub].get("tp_size", 1))
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ConfigError(f"tensor_parallel: got size {show(s)}, expected a non-negative integer.")
    return max(1, *sizes)
