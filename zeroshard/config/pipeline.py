"""What a config must say when the model is a PipelineModule, checked once at `initialize`
before any group is built: the refusals that used to be spread over initialize() and the
schedule builder. A pure function of the typed Config and the module's virtual stages.
Imports nothing of zeroshard but `errors` and `config.schema`.
"""

from __future__ import annotations

from zeroshard.config.schema import Config
from zeroshard.errors import ConfigConflictError, ConfigError, NotSupportedError

ONE_STAGE_PER_RANK = frozenset({"1f1b", "gpipe"})
"""`pipeline.schedule` values that run one stage per rank (torch's Schedule1F1B, ScheduleGPipe)."""


def check_for_pipeline(cfg: Config, virtual_stages: int) -> None:
    """Refuse, by name, what a pipeline cannot train with this config.

    Raises:
        ConfigConflictError: managed_gradient_accumulation false (train_batch owns the boundary).
        NotSupportedError: gradient_allreduce_op "sum".
        ConfigError: a one-stage-per-rank schedule with several virtual stages per rank.

    >>> from zeroshard.config import load_config
    >>> check_for_pipeline(load_config({"train_batch_size": 4}, dp_world_size=1), virtual_stages=2)
    Traceback (most recent call last):
    zeroshard.errors.ConfigError: pipeline.schedule: "1f1b" runs one stage per rank, but the PipelineModule has virtual_stages=2. Use "interleaved_1f1b" or "interleaved_zero_bubble", or build the module with virtual_stages=1
    """  # noqa: E501  the doctest's expected line is the error's one line
    if not cfg.managed_gradient_accumulation:
        raise ConfigConflictError(
            "managed_gradient_accumulation=False is not supported with pipeline parallelism (as in DeepSpeed): "
            "train_batch() runs gradient_accumulation_steps micro-batches and steps once; remove the key (or set "
            "it to true), or train the model without pipeline stages.")
    if cfg.gradient_allreduce_op == "sum":
        raise NotSupportedError(
            "not supported yet: gradient_allreduce_op='sum' with a PipelineModule (the pipeline engine averages "
            'its gradients over the data-parallel ranks); use "mean", or train the model without pipeline stages.')
    offload = cfg.zero_optimization.offload_optimizer
    for key, on in (("delayed_update", offload.delayed_update), ("ratio", offload.ratio < 1.0)):
        if on:
            raise NotSupportedError(
                f"not supported yet: zero_optimization.offload_optimizer.{key} with a PipelineModule (proven for "
                "the data-parallel engine only); remove it, or train without stages.")
    name = cfg.pipeline.schedule
    if name in ONE_STAGE_PER_RANK and virtual_stages != 1:
        raise ConfigError(
            f'pipeline.schedule: "{name}" runs one stage per rank, but the PipelineModule has '
            f"virtual_stages={virtual_stages}. Use \"interleaved_1f1b\" or \"interleaved_zero_bubble\", "
            "or build the module with virtual_stages=1")
