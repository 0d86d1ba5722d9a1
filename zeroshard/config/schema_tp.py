"""`tensor_parallel`: DeepSpeed 0.19.8's AutoTP training section, typed (see zeroshard/tensor_parallel/).

Key names and defaults follow DeepSpeed's `TPTrainingConfig`, `TPConfig` and the
`partition_config` dictionary its `AutoTPConfig.from_dict` reads. Imports nothing of zeroshard
outside config/ but `errors`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from zeroshard.config.fields import show, spec
from zeroshard.errors import ConfigError, NotSupportedError

PRESETS = ("llama", "qwen2", "mistral")
"""`preset_model` values zeroshard builds (separate q/k/v and gate/up projections)."""

DEEPSPEED_PRESETS = ("llama", "bloom", "chatglm", "mixtral", "deepseek_v2", "qwen2", "phi3", "mistral")
"""Every preset DeepSpeed 0.19.8 names (the fused-projection ones need sub-parameter shapes)."""

_SPEC_KEYS = {"patterns", "partition_type", "shape", "partition_dim", "model_types", "gather_output",
              "grad_allreduce"}


@dataclass(frozen=True, kw_only=True, slots=True)
class TPSubConfig:
    """`tensor_parallel.tensor_parallel` (alias `tp`): DeepSpeed's inference-style TP block."""

    tp_size: int = spec(1, ge=1)
    """Tensor-parallel size; the same as `autotp_size` (give one of them, or equal values)."""
    tp_grain_size: int = spec(1, ge=1)
    """DeepSpeed's granularity of uneven MLP splits (not active in its training path either).
    Accepted without effect: zeroshard splits every sharded dimension evenly (and refuses a
    dimension the size does not divide)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PartitionConfig:
    """`tensor_parallel.partition_config`: DeepSpeed's configurable AutoTP layer specs."""

    use_default_specs: bool = True
    """Merge `layer_specs` with the preset's specs (preset first); false: `layer_specs` alone."""
    layer_specs: tuple[Any, ...] = ()
    """Layer specs: objects with `patterns` (regexes over parameter names), `partition_type`
    ("column", "row" or "skip"), optional `partition_dim`, `model_types`, `gather_output`."""
    tp_size: int = spec(1, ge=1)
    """Overwritten by `autotp_size`, as in DeepSpeed."""
    embedding_partition_dim: int = spec(1, ge=0, le=1)
    """DeepSpeed's embedding split dimension. Accepted without effect: embeddings stay whole."""
    lm_head_patterns: tuple[str, ...] = ("lm_head", "embed_out")
    """Names of output heads (matched by the column spec with `gather_output`)."""
    strict_mode: bool = False
    """Raise when a Linear matches no spec (instead of keeping it whole)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallelConfig:
    """`tensor_parallel`: AutoTP training (shard the model's linear layers over `autotp_size` ranks;
    ZeRO then partitions each tensor-parallel rank's pieces over the data-parallel ranks)."""

    autotp_size: int = spec(0, ge=0)
    """Tensor-parallel size; 0 (the default) or 1 = no tensor parallelism."""
    tp_overlap_comm: bool = False
    """DeepSpeed: overlap the row-parallel all-reduce with computation. Accepted without effect:
    the all-reduce of a row-parallel output feeds the next operation directly."""
    vocab_parallel_lm_head: bool | None = None
    """Shard the vocabulary of the output head with a vocabulary-parallel loss (true), never
    (false), or as the model's plan says (null: an untied head is column-parallel with its output
    gathered, a tied one stays whole)."""
    vocab_parallel_ce_backend: Literal["torch", "liger"] = "torch"
    """Backend of the vocabulary-parallel cross entropy."""
    tensor_parallel: TPSubConfig = spec(default_factory=TPSubConfig)
    """DeepSpeed's `tp` block (legacy alias `tp`)."""
    partition_config: PartitionConfig = spec(default_factory=PartitionConfig)
    """Custom layer specs (DeepSpeed's configurable AutoTP)."""
    preset_model: str | None = None
    """A built-in set of layer specs: "llama", "qwen2", "mistral" (DeepSpeed's bloom, chatglm,
    mixtral, deepseek_v2 and phi3 need fused sub-parameter shapes: refused by name)."""
    keep_module_on_host: bool = False
    """DeepSpeed: keep loaded weights on the host. Accepted without effect: zeroshard shards
    the model where it was built and moves only each rank's pieces to its device."""
    replace_with_kernel_inject: bool = False
    """Inject DeepSpeed's inference kernels (alias `kernel_inject`)."""
    injection_policy_tuple: Any = None
    """DeepSpeed's legacy injection policy (a Python tuple of module classes)."""

    @property
    def size(self) -> int:
        """The tensor-parallel size: `autotp_size` or `tp.tp_size`, 1 when off."""
        return max(self.autotp_size, self.tensor_parallel.tp_size, 1)

    @property
    def enabled(self) -> bool:
        return self.size > 1


def check_tensor_parallel(tp: TensorParallelConfig) -> None:
    """Cross-field checks and what is not built, at load time.

    Raises:
        ConfigError: conflicting sizes or a malformed layer spec.
        NotSupportedError: a DeepSpeed option zeroshard does not build, named.
    """
    a, t = tp.autotp_size, tp.tensor_parallel.tp_size
    if a > 1 and t > 1 and a != t:
        raise ConfigError(f"tensor_parallel.autotp_size ({a}) and tensor_parallel.tp.tp_size ({t}) disagree; "
                          "give one of them.")
    if tp.preset_model is not None and tp.preset_model not in PRESETS:
        if tp.preset_model in DEEPSPEED_PRESETS:
            raise NotSupportedError(
                f"not supported yet: tensor_parallel.preset_model={show(tp.preset_model)}. Its fused projections "
                "need sub-parameter shapes, which zeroshard does not split yet. Use \"llama\" / \"qwen2\", or a "
                "partition_config with separate projections.")
        raise ConfigError(f"tensor_parallel.preset_model: got {show(tp.preset_model)}, expected one of "
                          f"{', '.join(show(p) for p in DEEPSPEED_PRESETS)} (or null).")
    for i, raw in enumerate(tp.partition_config.layer_specs):
        check_layer_spec(raw, f"tensor_parallel.partition_config.layer_specs[{i}]")


def check_layer_spec(raw: Any, where: str) -> None:
    """One `partition_config.layer_specs` entry: known keys, compiling patterns, a known type."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: got {show(raw)}, expected an object with \"patterns\" and \"partition_type\".")
    for key in raw:
        if key not in _SPEC_KEYS:
            from zeroshard.config.fields import unknown_key

            raise unknown_key(f"{where}.{key}", str(key), sorted(_SPEC_KEYS))
    patterns = raw.get("patterns")
    if not isinstance(patterns, (list, tuple)) or not patterns or not all(isinstance(p, str) for p in patterns):
        raise ConfigError(f"{where}.patterns: got {show(patterns)}, expected a non-empty list of regular expressions.")
    for p in patterns:
        try:
            re.compile(p)
        except re.error as e:
            raise ConfigError(f"{where}.patterns: {show(p)} is not a regular expression ({e}).") from None
    kind = str(raw.get("partition_type", "column")).lower()
    if kind not in ("column", "row", "skip"):
        raise ConfigError(f"{where}.partition_type: got {show(raw.get('partition_type'))}, expected "
                          "\"column\", \"row\" or \"skip\".")
    if raw.get("shape") is not None:
        raise NotSupportedError(f"not supported yet: {where}.shape={show(raw['shape'])}. Sub-parameter shapes "
                                "(fused projections) are not split yet; give separate projections.")
    if raw.get("grad_allreduce") and kind != "skip":
        raise ConfigError(f"{where}.grad_allreduce=true goes with partition_type \"skip\" (a whole parameter whose "
                          f"gradient is summed over the tensor-parallel group, as in DeepSpeed); got \"{kind}\".")
    dim, natural = raw.get("partition_dim"), 0 if kind == "column" else 1
    if dim is not None and kind != "skip" and dim != natural:
        raise NotSupportedError(f"not supported yet: {where}.partition_dim={show(dim)}. A {kind} split of a "
                                f"weight matrix is along dimension {natural}; remove the key.")
