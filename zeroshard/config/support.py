"""What zeroshard does not implement yet, as data; the loader raises NotSupportedError from it.

A key triggers only when set to a value other than its default (or its `allowed` values), so a
copied config that spells out defaults still loads. When a feature lands, delete its entry here
(and its line in docs/config.md is regenerated). Imports nothing of zeroshard but `errors` and
`config.fields`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from zeroshard.config.fields import default_at, get_dotted, show
from zeroshard.errors import NotSupportedError

_ZERO_STAGES = "zeroshard implements stages 0-3."
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
    Unsupported(key="zero_optimization.stage", allowed=(0, 1, 2, 3), why=_ZERO_STAGES, fix=_PLAN),
    Unsupported(key="zero_optimization.offload_optimizer.super_offload",
                why="DeepSpeed's SuperOffload is not implemented.", fix="Remove the key."),
    *(Unsupported(key=f"zero_optimization.{k}", why=_ZPP, fix="Remove the key.") for k in (
        "zero_quantized_nontrainable_weights", "mics_shard_size", "mics_hierarchical_params_gather")),
    Unsupported(key="zero_optimization.zenflow.offload", why="ZenFlow's selective optimizer states in CPU "
                "memory are not built.", fix="Set it to false."),
    Unsupported(key="zero_optimization.legacy_stage1", why="DeepSpeed's legacy stage 1 is not provided.",
                fix="Remove the key."),
    Unsupported(key="fp16.fp16_master_weights_and_grads",
                why="master weights are always fp32.", fix="Remove the key."),
    Unsupported(key="aio.use_gds", why="GPUDirect Storage is not built: swap I/O goes through page-aligned "
                "host buffers (zero/offload/nvme_io.py).", fix='Remove the key (or set it to false).'),
    *(Unsupported(key=f"checkpoint.{k}", why=f"checkpoint.{k} is not implemented (zeroshard's checkpoints "
                  "are one directory per tag, resharded on load).", fix="Remove the key.")
      for k in ("parallel_write", "checkpoint_serialization")),
    Unsupported(key="tensor_parallel.vocab_parallel_lm_head", allowed=(None, False),
                why="a vocabulary-parallel head and loss are not built (an untied head is column-parallel with "
                "its output gathered).", fix="Set it to null or false."),
    *(Unsupported(key=f"tensor_parallel.{k}", why=why, fix="Remove the key.") for k, why in (
        ("vocab_parallel_ce_backend", "the vocabulary-parallel cross entropy is not built."),
        ("replace_with_kernel_inject", "DeepSpeed's inference kernels are not provided."),
        ("injection_policy_tuple", "legacy injection policies are not read; give partition_config layer specs."),
    )),
    Unsupported(key="optimizer.legacy_fusion", why="DeepSpeed's legacy fused optimizers are not provided.",
                fix="Remove the key."),
    Unsupported(key="optimizer.params.bias_correction", allowed=(True,),
                why="torch's Adam always applies bias correction.", fix="Remove the key."),
    Unsupported(key="optimizer.params.cuda_aware", allowed=(False,), why="DeepSpeed's CUDA-aware MPI path "
                "for the 1-bit optimizers is not provided (the compressed all-reduce runs on the job's process "
                "group, which moves device tensors directly).", fix="Remove the key (or set it to false)."),
    Unsupported(key="sparse_gradients", why="sparse embedding gradients are not implemented.",
                fix="Remove the key."),
    Unsupported(key="disable_allgather", why="broadcast-based parameter gathering is not provided.",
                fix="Remove the key."),
    Unsupported(key="memory_breakdown", why="per-phase memory logging is not implemented.",
                fix="Remove the key."),
    Unsupported(key="dataloader_drop_last", why="dropping the last partial batch is not implemented.",
                fix="Drop it in your dataset, and remove the key."),
    Unsupported(key="zero_optimization.load_from_fp32_weights", why="loading always rebuilds the 16-bit "
                "weights from the fp32 master copy.", fix="Remove the key."),
    Unsupported(key="compile.deepcompile", why="DeepCompile (DeepSpeed's own compiler passes for ZeRO, "
                "GPU-oriented) is not implemented; engine.compile() compiles the model with torch.compile and "
                "keeps zeroshard's ZeRO hooks and collectives eager.",
                fix="Remove the key (or set it to false) and call engine.compile()."),
    Unsupported(key="compile.autoep_non_moe", why="engine.compile() compiles the whole model; keeping the AutoEP "
                "layers eager is not built.", fix="Remove the key; engine.compile() compiles the whole model."),
    *(Unsupported(key=f"expert_parallel.{k}", why="zeroshard's AutoEP runs the model's own router (its top-k, "
                  "scores, normalisation, scaling and group-limited choice), so a router described in the config "
                  "is not built.", fix="Remove the key (\"auto\" / null: the model's router decides).")
      for k in ("top_k", "score_func", "route_norm", "route_scale", "routed_scaling_factor", "num_expert_groups",
                "num_limited_groups", "score_apply")),
    *(Unsupported(key=f"expert_parallel.{k}", why="zeroshard's AutoEP finds every transformers-5 expert bank by "
                  "its structure; custom-model descriptions are not read.", fix="Remove the key.")
      for k in ("moe_layer_pattern", "expert_pattern", "router_pattern", "expert_w1", "expert_w2", "expert_w3",
                "num_experts_attr", "top_k_attr", "has_shared_experts", "shared_experts_pattern",
                "shared_experts_gate_pattern", "expert_activation")),
    Unsupported(key="expert_parallel.comm_backend", why="DeepEP is not built: tokens move by all-to-all over the "
                "expert-parallel group.", fix="Remove the key (or set it to \"comm\")."),
    Unsupported(key="expert_parallel.expert_tensor_parallel_size", why="tensor parallelism inside experts is not "
                "built.", fix="Remove the key (or set it to 1)."),
    *(Unsupported(key=f"expert_parallel.{k}", why=f"DeepSpeed's AutoEP x AutoTP option {k} has no meaning without "
                  "AutoTP folding, which is not built.", fix="Remove the key (or set it to false).")
      for k in ("validate_folding_routing", "async_split_plan")),
    Unsupported(key="compile", why="It tunes DeepCompile, which is not implemented (DeepSpeed reads it only "
                "with compile.deepcompile true).", fix="Remove the key; engine.compile() needs none."),
    *(Unsupported(key=f"zero_optimization.{k}", why=why, fix="Remove the key.") for k, why in (
        ("stage3_use_all_reduce_for_fetch_params", "stage 3 always gathers parameters with all-gather."),
        ("stage3_allgather_sequential", "stage 3 always issues one all-gather per unit."),
        ("override_module_apply", "partitioned parameters are always gathered for Module.apply."),
    )),
)
"""Keys with values zeroshard rejects as not supported yet. Checked in order."""

UNSUPPORTED_OPTIMIZERS: dict[str, str] = {
    "lion": "Lion", "muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD", "muon": "Muon",
}
"""DeepSpeed optimizer types zeroshard does not provide: lower-case name -> DeepSpeed's name."""

UNMODELLED: dict[str, str] = {
    name: f"DeepSpeed's {name} feature is not implemented." for name in (
        "amp", "flops_profiler", "autotuning", "eigenvalue", "progressive_layer_drop",
        "curriculum_learning", "data_efficiency", "sparse_attention", "compression_training",
        "hybrid_engine", "nebula", "datastates", "elasticity", "weight_quantization",
        "comet", "quantize_training", "graph_harvesting", "timers",
        "use_data_before_expert_parallelism", "vocabulary_size",
        "disable_python_gc", "log_level",
        "zero_optimization.zeropp_loco_param",
        "checkpoint.writer",
    )
}
"""DeepSpeed keys and sections zeroshard does not model. Accepted when they ask for nothing
(`is_inactive`); anything else raises NotSupportedError naming the key."""


def _all_off(value: Any, gates: Mapping[str, tuple[Any, ...]]) -> bool:
    """A section whose gate keys all hold an "off" value (other keys only tune the gated feature)."""
    return isinstance(value, Mapping) and all(value.get(k, off[0]) in off for k, off in gates.items())


OFF_VALUES: dict[str, Callable[[Any], bool]] = {
    "vocabulary_size": lambda v: v is None,
}
"""UNMODELLED keys whose DeepSpeed default (or "off") spelling is more than null/false/{}:
key -> predicate that is true when the value asks for nothing."""


OFF_HINTS: dict[str, str] = {
    "log_level": 'Remove it, and set the level of the "zeroshard" logger in the script '
                 '(logging.getLogger("zeroshard").setLevel(...)).',
}
"""The "asks for nothing" spelling to suggest for UNMODELLED keys where it is not false / {}."""


def is_inactive(value: Any, key: str = "") -> bool:
    """True for the spellings of "feature off": null, false, {}, [], {"enabled": false}, or
    the key's own off values (OFF_VALUES), e.g. `"expert_parallel": {"enabled": false}`."""
    if value is None or value is False or value == {} or value == []:
        return True
    if key in OFF_VALUES:
        try:
            return bool(OFF_VALUES[key](value))
        except (AttributeError, TypeError):
            return False
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


def check_supported(cfg: Any, unmodelled: Mapping[str, Any], pending: Iterable[NotSupportedError],
                    skip: Container[str] = ()) -> None:
    """Raise NotSupportedError for the first unsupported value in `cfg`.

    Args:
        cfg: the built Config.
        unmodelled: dotted key -> raw value for UNMODELLED keys found in the file.
        pending: errors the parser deferred (e.g. an unsupported optimizer type), raised first.
        skip: keys with no effect at the chosen ZeRO stage (another stage's tuning knobs), which
            are noted rather than refused.
    """
    for err in pending:
        raise err
    for key, value in unmodelled.items():
        if not is_inactive(value, key):
            raise not_supported(key, value, UNMODELLED[key], OFF_HINTS.get(key, "Remove it, or set it to false / {}."))
    for entry in NOT_SUPPORTED:
        try:
            target = get_dotted(cfg, entry.key)
        except KeyError:
            continue
        paths = list(_leaves(target, entry.key + ".")) if dataclasses.is_dataclass(target) else [entry.key]
        for path in paths:
            if path in skip:
                continue
            hit = _violation(cfg, entry, path)
            if hit is not None:
                raise not_supported(path, hit[0], entry.why, entry.fix)


def status_of(key: str) -> Unsupported | None:
    """The NOT_SUPPORTED entry covering dotted `key` (itself or a section above it), if any."""
    for entry in NOT_SUPPORTED:
        if key == entry.key or key.startswith(entry.key + "."):
            return entry
    return None
