"""`fp8`: FP8 training of linear layers, typed (see runtime/fp8.py). zeroshard's extension:
DeepSpeed 0.19.8 has no FP8 training section (its `fp_quantizer` ops are kernels, not a config).

Accelerate's `mixed_precision="fp8"` with a DeepSpeed plugin sets `bf16.enabled` in the ds_config
and converts the model itself (torchao or Transformer Engine) before `deepspeed.initialize`, so
nothing FP8-specific reaches DeepSpeed's config; this section is how a zeroshard config asks for
it (docs/precision.md). Imports nothing of zeroshard outside config/ but `errors`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from zeroshard.config.fields import show
from zeroshard.errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Config:
    """`fp8`: run the GEMMs of the model's linear layers in float8 (zeroshard's extension)."""

    enabled: bool = False
    """zeroshard's extension: at `initialize`, after AutoTP splits the model and before ZeRO packs
    it, the eligible linear layers run their forward, input-gradient and weight-gradient GEMMs in
    float8 with scales from each tensor's current amax (dynamic scaling). Parameters, gradients,
    master weights and optimizer state keep the engine's precision (fp32, or bf16 with fp32
    masters): float8 exists only inside each GEMM. Needs bf16 or fp32, not fp16."""
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """zeroshard's extension: the scaling recipe, as torchao names them. "tensorwise": one scale
    per tensor, inputs and weights e4m3, output gradients e5m2. "rowwise": one power-of-two scale
    per row along each GEMM's contraction axis, every operand e4m3 (more accurate, more work)."""
    exclude: tuple[str, ...] = ()
    """zeroshard's extension: regular expressions (`re.search`) on module names; a linear layer
    whose name matches stays in high precision, e.g. ["lm_head", "attn\\\\.qkv"]."""
    backend: Literal["zeroshard", "torchao"] = "zeroshard"
    """zeroshard's extension: whose float8 layers run. "zeroshard": runtime/fp8.py (no dependency;
    also inside AutoTP's split layers and pipeline stages). "torchao": torchao's
    `convert_to_float8_training` on the same layers with the same recipe (torchao must be
    installed; AutoTP and pipelines are refused with it)."""
    float8_all_gather: bool = False
    """zeroshard's extension: at ZeRO stage 3, gather the float8 layers' weights as e4m3 codes (one
    byte per element instead of two or four), with one all-reduce of their amaxes per step
    (torchtitan's `enable_fsdp_float8_all_gather` with precomputed scales). The forward and both
    gradients are the same bits as without it (zero/float8_gather.py). Tensorwise recipe, stage 3,
    without qwZ, hpZ or parameter offload."""
    keep_first_last: bool = True
    """zeroshard's extension: keep the first and the last linear layer (in module order) in high
    precision, as Accelerate's FP8 conversion does: the input and output projections are the most
    sensitive to float8 rounding. Layers whose dimensions are not multiples of 16 always stay."""


def check_fp8(fp8: Fp8Config, precision: str, zero: Any) -> None:
    """The section's own rules, its precision and (float8_all_gather) the ZeRO section, at load time.

    Raises:
        ConfigError: fp8 with fp16 training, an `exclude` pattern that does not compile, or
            float8_all_gather where it cannot apply.
    """
    for pattern in fp8.exclude:
        try:
            re.compile(pattern)
        except re.error as err:
            raise ConfigError(f"fp8.exclude: {show(pattern)} is not a regular expression ({err}); "
                              "escape special characters, e.g. \"h\\\\.0\\\\.mlp\".") from None
    if fp8.enabled and fp8.float8_all_gather:
        _check_float8_all_gather(fp8, zero)
    if fp8.enabled and precision == "fp16":
        raise ConfigError("fp8.enabled: FP8 training needs bf16 or fp32 parameters, and fp16.enabled is true "
                          "(fp16's loss scaling is not combined with float8 scaling); set bf16.enabled instead "
                          "of fp16 (Accelerate's mixed_precision=\"fp8\" does the same).")


def _check_float8_all_gather(fp8: Fp8Config, zero: Any) -> None:
    """float8_all_gather needs stage 3's gathers, one scale per weight, and the plain gather route."""
    key = "fp8.float8_all_gather"
    if zero.stage != 3:
        raise ConfigError(f"{key}: only ZeRO stage 3 gathers weights, and zero_optimization.stage is "
                          f"{zero.stage}; set stage 3 or remove the key.")
    if fp8.recipe != "tensorwise" or fp8.backend != "zeroshard":
        raise ConfigError(f"{key}: gathers one scale per weight, so it needs fp8.recipe \"tensorwise\" and "
                          f"fp8.backend \"zeroshard\" (got {show(fp8.recipe)}, {show(fp8.backend)}).")
    for name, on in (("zero_optimization.zero_quantized_weights", zero.zero_quantized_weights),
                     ("zero_optimization.zero_hpz_partition_size", zero.zero_hpz_partition_size > 1),
                     ("zero_optimization.offload_param", zero.offload_param.device != "none")):
        if on:
            raise ConfigError(f"{key}: not combined with {name} (another gather route); remove one of them.")
