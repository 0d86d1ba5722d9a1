"""`zero_optimization.zenflow`: when the section is on, how DeepSpeed 0.19.8 validates it, what
zeroshard does not build of it, and the epoch length its "epoch" / "auto" select strategies read.
Imports nothing of zeroshard but `config` and `errors`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from zeroshard.config.fields import show
from zeroshard.config.parse import Draft
from zeroshard.config.schema import Config
from zeroshard.config.schema_zero import ZenFlowConfig, ZeroConfig
from zeroshard.errors import ConfigError, NotSupportedError

logger = logging.getLogger("zeroshard")

_ZENFLOW = "zero_optimization.zenflow"


def mark_zenflow(cfg: Config, raw: Mapping[str, Any], draft: Draft) -> Config:
    """A `zenflow` section turns ZenFlow on, an empty one too (DeepSpeed: `zenflow` is None unless given)."""
    zero = raw.get("zero_optimization")
    given = isinstance(zero, Mapping) and zero.get("zenflow") is not None
    given = given or any(k.startswith(_ZENFLOW + ".") for k in (*draft.values, *draft.sources))
    if not given:
        return cfg
    return _with_section(cfg, dataclasses.replace(cfg.zero_optimization.zenflow, enabled=True))


def _with_section(cfg: Config, section: ZenFlowConfig) -> Config:
    return dataclasses.replace(cfg, zero_optimization=dataclasses.replace(cfg.zero_optimization, zenflow=section))


def check_zenflow(cfg: Config) -> None:
    """ZenFlow as DeepSpeed 0.19.8 validates it (runtime/zenflow/engine.py::configure_zenflow,
    zenflow_stage_1_and_2.py::_configure_zenflow), and what zeroshard does not build of it."""
    zf, zero = cfg.zero_optimization.zenflow, cfg.zero_optimization
    if not zf.enabled:
        return
    if zero.stage not in (1, 2, 3):
        raise NotSupportedError(f"{_ZENFLOW} with ZeRO stage {zero.stage}: not implemented; ZenFlow is built for "
                                "stages 1, 2 and 3 (as in DeepSpeed, which needs an optimizer partition too).")
    if zero.offload_optimizer.device != "cpu":
        device = show(zero.offload_optimizer.device)
        raise ConfigError(f'{_ZENFLOW}: ZenFlow must be used with CPU offload (as in DeepSpeed); set '
                          f'zero_optimization.offload_optimizer.device to "cpu" (got {device}).')
    _check_zero3(zero)
    if zero.offload_optimizer.delayed_update:
        raise NotSupportedError(f"{_ZENFLOW} with offload_optimizer.delayed_update: not implemented (both schedule "
                                "the CPU step); use one of them.")
    if zf.select_strategy == "auto" and not isinstance(zf.select_interval, str):
        raise ConfigError(f'{_ZENFLOW}.select_interval: got {zf.select_interval} with select_strategy "auto", '
                          "which selects once per epoch (DeepSpeed raises here too); remove select_interval, or set "
                          'select_strategy to "step" or "epoch".')
    if zf.select_strategy != "auto" and isinstance(zf.select_interval, str):
        unit = "epochs" if zf.select_strategy == "epoch" else "steps"
        raise ConfigError(f'{_ZENFLOW}.select_interval: "auto" goes with select_strategy "auto" only (as in '
                          f"DeepSpeed); set it to a number of {unit}.")
    if isinstance(zf.select_interval, int) and zf.select_interval < 0:
        raise ConfigError(f"{_ZENFLOW}.select_interval: got {zf.select_interval}, expected an integer >= 0.")
    if isinstance(zf.update_interval, int) and zf.update_interval < 1:
        raise ConfigError(f"{_ZENFLOW}.update_interval: got {zf.update_interval}, expected an integer >= 1 (as in "
                          "DeepSpeed).")
    _check_intervals(zf)
    for key, on, why in (
            ("fp16 training", cfg.precision == "fp16",
             "DeepSpeed skips fp16 overflow steps around ZenFlow's two optimizers, which is not built. Use bf16 "
             "or fp32"),
            ("bf16.bf16_master_weights_and_grads", cfg.bf16_masters,
             "ZenFlow keeps fp32 masters and an fp32 accumulated gradient in host memory; set it to false")):
        if on:
            raise NotSupportedError(f"{_ZENFLOW} with {key}: not implemented ({why}).")


def _check_zero3(zero: ZeroConfig) -> None:
    """At stage 3 ZenFlow writes each step's values into the rank's parameter shard in place and
    steps every master element on the CPU: what keeps that shard elsewhere or splits the master
    is not built with it."""
    if zero.stage != 3:
        return
    for key, on, why in (
            ("offload_param", zero.offload_param.device != "none",
             f"the parameter shard at a {zero.offload_param.device} home; set offload_param.device to \"none\""),
            ("offload_optimizer.ratio", zero.offload_optimizer.ratio < 1.0,
             "part of the master on the accelerator; set the ratio to 1"),
            ("zero_quantized_weights", zero.zero_quantized_weights, "set it to false"),
            ("zero_hpz_partition_size", zero.zero_hpz_partition_size > 1, "set it to 1")):
        if on:
            raise NotSupportedError(f"{_ZENFLOW} with zero_optimization.{key} at ZeRO stage 3: not implemented "
                                    f"({why}).")


def _check_intervals(zf: ZenFlowConfig) -> None:
    """DeepSpeed's check, on the select interval in steps (an "epoch" one once its length is known)."""
    if isinstance(zf.update_interval, str):  # "auto": DeepSpeed skips the check
        return
    select = zf.select_steps
    if select != 0 and select < zf.update_interval:
        unit = "" if zf.select_strategy == "step" else f" ({zf.select_interval} epochs of {zf.steps_per_epoch} steps)"
        raise ConfigError(f"{_ZENFLOW}.select_interval: {select} steps{unit}, below update_interval "
                          f"({zf.update_interval}); select interval must be greater or equal to update interval "
                          "(as in DeepSpeed).")


def with_steps_per_epoch(cfg: Config, loader_steps: int | None) -> Config:
    """The epoch length of the "epoch" and "auto" select strategies, as DeepSpeed's configure_zenflow
    takes it: the training data loader's length, here in optimizer steps (`len(loader)` //
    gradient_accumulation_steps; DeepSpeed's ZenFlow steps are micro-steps). Without a loader,
    `steps_per_epoch` from the file is kept; without either the columns are selected once, after
    the warm-up, as in DeepSpeed (its select_interval 0), and a note says so.

    Raises:
        ConfigError: the resolved select interval is below update_interval.
    """
    zf = cfg.zero_optimization.zenflow
    if not zf.enabled or zf.select_strategy == "step":
        return cfg
    steps = loader_steps or zf.steps_per_epoch
    if steps is None:
        logger.info(f'{_ZENFLOW}: select_strategy "{zf.select_strategy}" without a training data loader '
                    "(initialize(training_data=...)) or steps_per_epoch: the columns are selected once, after the "
                    "warm-up (as DeepSpeed does)")
        return cfg
    section = dataclasses.replace(zf, steps_per_epoch=steps)
    _check_intervals(section)
    return _with_section(cfg, section)
