"""What zeroshard does not implement yet, as data; the loader raises NotSupportedError from it.

A key triggers only when set to a value other than its default (or its `allowed` values), so a
copied config that spells out defaults still loads. When a feature lands, delete its entry here
(and its line in docs/config.md is regenerated). Imports nothing of zeroshard but `errors` and
`config.fields`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from zeroshard.config.fields import default_at, get_dotted, show
from zeroshard.errors import NotSupportedError

_STAGES = "zeroshard implements stages 0-3."
_PLAN = "Use a stage between 0 and 3."
_ZPP = "ZeRO++ / MiCS communication tricks are not implemented."


@dataclass(frozen=True, kw_only=True, slots=True)
class Unsupported:
    """A DeepSpeed key (or every key below a section) whose non-default values zeroshard lacks."""

    key: str
    """Dotted key, or a section prefix meaning every key below it."""
    why: str
    """What is missing."""
    fix: str
    """What the user can do today."""
    allowed: tuple[Any, ...] | None = None
    """Values that are supported; None = only the schema default."""


NOT_SUPPORTED: tuple[Unsupported, ...] = (
    Unsupported(key="zero_optimization.stage", allowed=(0, 1, 2, 3), why=_STAGES, fix=_PLAN),
    Unsupported(key="zero_optimization.offload_optimizer.device", allowed=("none", "cpu"),
                why="optimizer offload to NVMe is not implemented.", fix='Use "device": "cpu".'),
    Unsupported(key="zero_optimization.offload_optimizer.super_offload",
                why="DeepSpeed's SuperOffload is not implemented.", fix="Remove the key."),
    Unsupported(key="zero_optimization.offload_param.device", allowed=("none", "cpu"),
                why="parameter offload to NVMe is not implemented.", fix='Use "device": "cpu".'),
    *(Unsupported(key=f"zero_optimization.{k}", why=_ZPP, fix="Remove the key.") for k in (
        "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
        "zero_hpz_partition_size", "mics_shard_size", "mics_hierarchical_params_gather")),
    Unsupported(key="zero_optimization.legacy_stage1", why="DeepSpeed's legacy stage 1 is not provided.",
                fix="Remove the key."),
    Unsupported(key="fp16.auto_cast", why="casting model inputs to fp16 is not implemented.",
                fix="Cast the inputs in the model or data pipeline, and remove the key."),
    Unsupported(key="fp16.fp16_master_weights_and_grads",
                why="master weights are always fp32.", fix="Remove the key."),
    *(Unsupported(key=f"bf16.{k}", why="bf16 master weights, optimizer states and gradients are fp32; "
                  "bf16 steps are not checked for overflow.", fix="Remove the key.")
      for k in ("immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                "bf16_optimizer_states")),
    Unsupported(key="aio", why="asynchronous NVMe I/O comes with NVMe offload, which is not implemented.",
                fix="Remove the section."),
    Unsupported(key="checkpoint", why="checkpoint options are not implemented (zeroshard's checkpoints "
                "always validate tags and reshard on load).", fix="Remove the section."),
    Unsupported(key="optimizer.legacy_fusion", why="DeepSpeed's legacy fused optimizers are not provided.",
                fix="Remove the key."),
    Unsupported(key="optimizer.params.bias_correction", allowed=(True,),
                why="torch's Adam always applies bias correction.", fix="Remove the key."),
    Unsupported(key="sparse_gradients", why="sparse embedding gradients are not implemented.",
                fix="Remove the key."),
    Unsupported(key="disable_allgather", why="broadcast-based parameter gathering is not provided.",
                fix="Remove the key."),
    Unsupported(key="memory_breakdown", why="per-phase memory logging is not implemented.",
                fix="Remove the key."),
    Unsupported(key="dataloader_drop_last", why="dropping the last partial batch is not implemented.",
                fix="Drop it in your dataset, and remove the key."),
    Unsupported(key="zero_force_ds_cpu_optimizer", why="zeroshard has no DeepSpeed CPU optimizer to force.",
                fix="Remove the key."),
)
"""Keys with values zeroshard rejects as not supported yet. Checked in order."""

UNSUPPORTED_OPTIMIZERS: dict[str, str] = {
    "onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb",
    "lion": "Lion", "muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD", "muon": "Muon",
}
"""DeepSpeed optimizer types zeroshard does not provide: lower-case name -> DeepSpeed's name."""

UNMODELLED: dict[str, str] = {
    name: f"DeepSpeed's {name} feature is not implemented." for name in (
        "amp", "torch_autocast", "flops_profiler", "autotuning", "eigenvalue", "progressive_layer_drop",
        "curriculum_learning", "data_efficiency", "sparse_attention", "pipeline", "compression_training",
        "hybrid_engine", "nebula", "datastates", "elasticity", "weight_quantization", "compile",
        "tensor_parallel", "comet", "quantize_training", "graph_harvesting", "timers",
        "seq_parallel_communication_data_type", "use_data_before_expert_parallelism", "vocabulary_size",
        "zero_optimization.zenflow", "zero_optimization.zeropp_loco_param", "zero_optimization.leaf_module",
        "checkpoint.writer",
    )
}
"""DeepSpeed keys and sections zeroshard does not model. Accepted when absent, null, false, {}
or {"enabled": false}; anything else raises NotSupportedError."""


def is_inactive(value: Any) -> bool:
    """True for the spellings of "feature off": null, false, {}, [] or {"enabled": false}."""
    if value is None or value is False or value == {} or value == []:
        return True
    return isinstance(value, Mapping) and value.get("enabled") is False


def not_supported(key: str, value: Any, why: str, fix: str) -> NotSupportedError:
    """The uniform message: "not supported yet: <key>=<value>. <why> <fix>"."""
    return NotSupportedError(f"not supported yet: {key}={show(value)}. {why} {fix}")


def _leaves(obj: Any, prefix: str) -> Iterable[str]:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def _violation(cfg: Any, entry: Unsupported, path: str) -> Any:
    try:
        value = get_dotted(cfg, path)
    except KeyError:
        return None
    if entry.allowed is not None:
        return None if value in entry.allowed else (value,)
    default = default_at(cfg, path)
    if default is dataclasses.MISSING or value == default:
        return None
    return (value,)


def check_supported(cfg: Any, unmodelled: Mapping[str, Any], pending: Iterable[NotSupportedError]) -> None:
    """Raise NotSupportedError for the first unsupported value in `cfg`.

    Args:
        cfg: the built Config.
        unmodelled: dotted key -> raw value for UNMODELLED keys found in the file.
        pending: errors the parser deferred (e.g. an unsupported optimizer type), raised first.
    """
    for err in pending:
        raise err
    for key, value in unmodelled.items():
        if not is_inactive(value):
            raise not_supported(key, value, UNMODELLED[key], "Remove it, or set it to false / {}.")
    for entry in NOT_SUPPORTED:
        try:
            target = get_dotted(cfg, entry.key)
        except KeyError:
            continue
        paths = list(_leaves(target, entry.key + ".")) if dataclasses.is_dataclass(target) else [entry.key]
        for path in paths:
            hit = _violation(cfg, entry, path)
            if hit is not None:
                raise not_supported(path, hit[0], entry.why, entry.fix)


def status_of(key: str) -> Unsupported | None:
    """The NOT_SUPPORTED entry covering dotted `key` (itself or a section above it), if any."""
    for entry in NOT_SUPPORTED:
        if key == entry.key or key.startswith(entry.key + "."):
            return entry
    return None
