"""Which ZeRO stages each `zero_optimization` key applies to, as data, and the check.

Users keep one ds_config template for every stage, so a *tuning* key of another stage (bucket
sizes, stage3_* thresholds, sub_group_size at stage 1/2, reduce_scatter at stage 3) is accepted
with one start-up note listing what has no effect. So is `offload_param` below stage 3: real
clients write it at every stage (DeepSpeed-Chat's `--offload`), DeepSpeed ignores it there, and
the note says it has no effect. A key that *requests* something the chosen stage cannot deliver
(offload_optimizer at stage 0, ZeRO++ below stage 3) is an error naming the stage where it
applies: DeepSpeed ignores it silently and the user believes it works.
Imports nothing of zeroshard but `errors` and `config.fields`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from zeroshard.config.fields import default_at, get_dotted, show
from zeroshard.errors import ConfigError

_NON_DEFAULT = object()
_Z = "zero_optimization."


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroStageRule:
    """`key` only has an effect at `stages`."""

    key: str
    """Dotted key the error names."""
    zero_stages: tuple[int, ...]
    """Stages the key applies to."""
    trigger: str = ""
    """Dotted leaf whose value activates the rule ("" = `key` itself)."""
    active_value: Any = _NON_DEFAULT
    """Value of the trigger that activates the rule; by default any non-default value."""
    request: bool = False
    """True: the key asks for something the other stages cannot deliver (an error there).
    False: a tuning knob, noted once at start-up and otherwise without effect there."""


def _zero_stage3(*names: str, request: bool = False) -> tuple[ZeroStageRule, ...]:
    return tuple(ZeroStageRule(key=_Z + n, zero_stages=(3,), request=request) for n in names)


def _zero_stage12(*names: str) -> tuple[ZeroStageRule, ...]:
    return tuple(ZeroStageRule(key=_Z + n, zero_stages=(1, 2)) for n in names)


ZERO_STAGE_RULES: tuple[ZeroStageRule, ...] = (
    # Noted, not refused: clients write it at every stage (DeepSpeed-Chat's --offload; DeepSpeed ignores it).
    ZeroStageRule(key=_Z + "offload_param", trigger=_Z + "offload_param.device", zero_stages=(3,)),
    ZeroStageRule(key=_Z + "offload_optimizer", trigger=_Z + "offload_optimizer.device", zero_stages=(1, 2, 3),
                  request=True),
    ZeroStageRule(key=_Z + "offload_optimizer.ratio", zero_stages=(3,), request=True),
    *_zero_stage3(
        "zero_hpz_partition_size",
        "zero_quantized_weights",
        "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients",
        "mics_shard_size",
        "mics_hierarchical_params_gather",
        request=True,
    ),
    *_zero_stage3(
        "sub_group_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
        "stage3_model_persistence_threshold",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_release_grads",
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params",
        "stage3_allgather_sequential",
        "memory_efficient_linear",
        "override_module_apply",
        "log_trace_cache_warnings",
        "enable_sanity_checks",
        "save_muon_momentum_buffer_in_memory",
        "leaf_module",
    ),
    *_zero_stage12(
        "reduce_scatter",
        "use_multi_rank_bucket_allreduce",
        "allgather_partitions",
        "allgather_bucket_size",
        "elastic_checkpoint",
        "ignore_unused_parameters",
        "round_robin_gradients",
    ),
    ZeroStageRule(key=_Z + "legacy_stage1", zero_stages=(1,), request=True),
    ZeroStageRule(key=_Z + "load_from_fp32_weights", zero_stages=(1, 2, 3)),
)
"""Keys of zero_optimization that do not apply at every stage. Keys absent here apply to all
stages (reduce_bucket_size, overlap_comm, contiguous_gradients: stage 0 uses or accepts them)."""


def zero_stages_of(key: str) -> tuple[int, ...] | None:
    """The stages a dotted key applies to (from its unconditional rule), or None for all."""
    for rule in ZERO_STAGE_RULES:
        if rule.key == key and rule.active_value is _NON_DEFAULT:
            return rule.zero_stages
    return None


def _words(zero_stages: tuple[int, ...], joiner: str) -> str:
    names = [str(s) for s in zero_stages]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" {joiner} " + names[-1]


def _is_active(cfg: Any, rule: ZeroStageRule) -> tuple[bool, Any]:
    trigger = rule.trigger or rule.key
    value = get_dotted(cfg, trigger)
    if rule.active_value is _NON_DEFAULT:
        default = default_at(cfg, trigger)
        return default is not dataclasses.MISSING and value != default, value
    return value == rule.active_value, value


ZERO_STAGE0_OPTIMIZERS = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")
"""Optimizers that average whole momenta over the data-parallel ranks: stage 0 only."""


def check_zero_stages(cfg: Any) -> tuple[str, ...]:
    """Raise for the first request the chosen stage cannot deliver; note tuning keys of other stages.

    Returns:
        () or one start-up note naming every tuning key set for another stage (no effect here).

    Raises:
        ConfigError: e.g. "zero_optimization.zero_quantized_weights = true applies to stage 3
            only; you chose stage 2. Remove it or set stage to 3."
    """
    zero_stage = cfg.zero_optimization.stage
    optimizer = getattr(cfg, "optimizer", None)
    if optimizer is not None and optimizer.type in ZERO_STAGE0_OPTIMIZERS and zero_stage != 0:
        raise ConfigError(
            f"optimizer.type {optimizer.type} applies to zero_optimization.stage 0 only (plain data "
            f"parallelism: it all-reduces the whole momentum; DeepSpeed refuses it with ZeRO too); you "
            f"chose stage {zero_stage}. Set stage to 0, or use Adam at stage {zero_stage}.")
    idle: list[str] = []
    for rule in ZERO_STAGE_RULES:
        if zero_stage in rule.zero_stages:
            continue
        active, value = _is_active(cfg, rule)
        if not active:
            continue
        if not rule.request:
            where = "/".join(str(s) for s in rule.zero_stages)
            idle.append(f"{rule.key.removeprefix(_Z)} (stage {where})")
            continue
        label = rule.key if rule.trigger else f"{rule.key} = {show(value)}"
        scope = f"stage {rule.zero_stages[0]} only" if len(rule.zero_stages) == 1 else (
            f"stages {_words(rule.zero_stages, 'and')}" + (" only" if len(rule.zero_stages) < 3 else ""))
        raise ConfigError(
            f"{label} applies to {scope}; you chose stage {zero_stage}. "
            f"Remove it or set stage to {_words(rule.zero_stages, 'or')}."
        )
    if not idle:
        return ()
    return (f"zero_optimization: set for another ZeRO stage, no effect at stage {zero_stage}: "
            f"{', '.join(idle)}. Accepted so one config serves every stage.",)


def idle_keys(cfg: Any) -> frozenset[str]:
    """Tuning keys (not requests) of zero_optimization that do not apply at the chosen stage."""
    zero_stage = cfg.zero_optimization.stage
    return frozenset(r.key for r in ZERO_STAGE_RULES if not r.request and zero_stage not in r.zero_stages)
