"""What ``initialize`` does for sequence parallelism: the size (from the config's
``sequence_parallel_size`` or an ALST mpu), the refusals of what is not built, the groups, and the
gradient factor.

Note: [sequence-parallel gradients]
Each rank of a sequence-parallel group runs the model on its slice of the same sample and
backpropagates its *share* of the loss: the shares of one group add up to the sample's loss
(`token_weighted_loss` in sequence/loss.py builds such a share from a per-rank mean, as
Transformers' Trainer does). Attention's all-to-alls carry every share's gradient to the rank
whose activations produced it, so a parameter's full gradient is the *sum* of the group's
gradients; the data-parallel ranks see different samples and are *averaged*. ZeRO reduces over
the dp x sp ranks with a mean (a division by dp x sp), so the engine multiplies each backward by
sp and the mean becomes sum-over-sp / dp at every ZeRO stage and with offload, exactly. DeepSpeed
0.19.8 does the same at ZeRO 0-2 (it divides by dp x sp / sp) but averages at ZeRO 3 (fixed in
0.20.2, deepspeedai/DeepSpeed#8854); zeroshard follows the maths at every stage
(docs/deepspeed-differences.md). With ``gradient_allreduce_op: "sum"`` nothing is divided, so
nothing is multiplied. The `deepspeed` alias presents itself as DeepSpeed 0.19.8 and its clients
compensate for that version's ZeRO-3 averaging (Transformers' Trainer scales the loss by sp), so an
engine built through the alias keeps 0.19.8's average at ZeRO 3 (`keep_deepspeed_zero3_average`).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from zeroshard.comm import ProcessGroups, get_global_rank, get_world_size
from zeroshard.comm.parallel_dims import ParallelDims
from zeroshard.config.schema import Config
from zeroshard.errors import ConfigError, NotSupportedError
from zeroshard.sequence.sp_groups import SequenceGroups, create_sequence_groups
from zeroshard.sequence.ulysses import DistributedAttention

logger = logging.getLogger(__name__)


def is_sequence_mpu(mpu: Any) -> bool:
    """An mpu that describes sequence parallelism only (DeepSpeed's ``parallel_state_sp``, which ALST's
    ``register_with_transformers`` returns): it can initialize sequence parallelism and has no
    data-parallel queries (DeepSpeed's own test for it); its model-parallel queries answer the
    sequence group."""
    return (mpu is not None and hasattr(mpu, "initialize_sequence_parallel")
            and not hasattr(mpu, "get_data_parallel_world_size"))


def check_megatron_sequence_mpu(mpu: Any) -> None:
    """A Megatron-style mpu (data- and model-parallel groups) that also reports sequence parallelism
    (Megatron-DeepSpeed's Ulysses) is refused by name: its groups are not read for SP yet.

    Raises:
        NotSupportedError: the mpu's sequence-parallel size is above 1.
    """
    if mpu is None or is_sequence_mpu(mpu) or not hasattr(mpu, "get_sequence_parallel_world_size"):
        return
    size = mpu.get_sequence_parallel_world_size()
    if isinstance(size, int) and size > 1:
        raise NotSupportedError(
            f"initialize(mpu=...): the mpu has data- and model-parallel groups and a sequence-parallel size of {size} "
            "(Megatron-DeepSpeed's Ulysses); zeroshard reads sequence parallelism from DeepSpeed's parallel_state_sp "
            "mpu or the config's sequence_parallel_size only. Drop the mpu's sequence parallelism, or use those.")


def sequence_size(config_sp: int, mpu: Any, mesh_param: Any = None) -> int:
    """The sequence-parallel size: the config's ``sequence_parallel_size``, an ALST mpu's, or
    ``initialize(mesh_param=(dp, sp))``'s (DeepSpeed's data x sequence device mesh); those given
    must agree.

    Raises:
        ConfigError: they disagree, or `mesh_param` is not two positive integers.
    """
    asked = [("sequence_parallel_size in the config", config_sp)] if config_sp > 1 else []
    if is_sequence_mpu(mpu):
        asked.append(("the mpu's sequence-parallel group", int(mpu.get_sequence_parallel_world_size())))
    if mesh_param is not None:
        asked.append(("mesh_param's second size", mesh_shape(mesh_param)[1]))
    sizes = {size for _, size in asked}
    if len(sizes) > 1:
        raise ConfigError("the sequence-parallel size is asked for more than once, with different values: "
                          + ", ".join(f"{who} = {size}" for who, size in asked) + "; make them equal (or give one).")
    return sizes.pop() if sizes else 1


def mesh_shape(mesh_param: Any) -> tuple[int, int]:
    """DeepSpeed's ``mesh_param``: (data-parallel size, sequence-parallel size).

    Raises:
        ConfigError: anything else.
    """
    if (not isinstance(mesh_param, (tuple, list)) or len(mesh_param) != 2
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in mesh_param)):
        raise ConfigError(f"initialize(mesh_param={mesh_param!r}): expected (data_parallel_size, "
                          "sequence_parallel_size), two positive integers, as DeepSpeed's device mesh takes them.")
    return int(mesh_param[0]), int(mesh_param[1])


def check_sequence_layout(dims: ParallelDims, cfg: Config, *, pipeline: bool, mesh_param: Any = None) -> None:
    """What sequence parallelism is not built with, refused by name before any group is made.

    Raises:
        ConfigError: `data_parallel_size` (or mesh_param's first size) is not the data-parallel
            size the world leaves.
        NotSupportedError: sequence parallelism with a pipeline or tensor parallelism.
    """
    for who, dp in (("data_parallel_size", cfg.data_parallel_size),
                    ("mesh_param's first size", mesh_shape(mesh_param)[0] if mesh_param is not None else None)):
        if dp is not None and dp != dims.dp:
            raise ConfigError(f"{who} is {dp}, but {dims.world_size} rank(s) as {dims.describe()} leave {dims.dp} "
                              f"data-parallel rank(s); set it to {dims.dp} or drop it.")
    if dims.sp == 1:
        return
    for what, present in (("a PipelineModule", pipeline), ("tensor parallelism", dims.tp > 1)):
        if present:
            raise NotSupportedError(
                f"sequence_parallel_size {dims.sp} together with {what} is not implemented yet: train with "
                "sequence and data parallelism only (ZeRO 0-3, offload), or set sequence_parallel_size to 1.")


def make_sequence_groups(dims: ParallelDims, seq_dp: ProcessGroups, model: nn.Module) -> SequenceGroups | None:
    """The sequence-parallel groups over ZeRO's group (None without sequence parallelism), after
    checking that the model's `DistributedAttention` layers exchange over those same ranks: a model
    built for sequence parallelism trained as plain data parallelism (or over other groups) would
    train on the wrong data with the wrong gradients, silently. Collective over the world.

    Raises:
        ConfigError: a `DistributedAttention` group that is not the engine's sequence-parallel group.
    """
    seq = create_sequence_groups(seq_dp, dims.sp) if dims.sp > 1 else None
    want = _ranks(seq.sp.dp_group, seq.size) if seq is not None else []
    for name, module in model.named_modules():
        if isinstance(module, DistributedAttention):
            size = get_world_size(module.spg)
            if size > 1 and _ranks(module.spg, size) != want:
                raise ConfigError(
                    f"{name or 'the model'} is a DistributedAttention over {size} ranks {_ranks(module.spg, size)}, "
                    f"but the engine's sequence-parallel group is {want or 'none'} (sequence_parallel_size {dims.sp}); "
                    f"set sequence_parallel_size to {size} in the config, or build the attention over "
                    "zeroshard.sequence.create_sequence_groups(...).sp.dp_group.")
    # Without SP here the process's groups stay (as DeepSpeed's parallel_state_sp globals do): a
    # second engine without SP (TRL's reference model) must not take them from the first.
    return seq


def _ranks(group: Any, size: int) -> list[int]:
    return [get_global_rank(group, i) for i in range(size)]


def loader_rank(groups: ProcessGroups, seq: SequenceGroups | None) -> tuple[int, int]:
    """(rank, world size) the data loader splits samples by: the ranks of a sequence-parallel group
    read the same samples."""
    return (groups.rank, groups.world_size) if seq is None else (seq.dp.rank, seq.dp.world_size)


def gradient_factor(cfg: Config, seq: SequenceGroups | None, sums: bool = True) -> float:
    """What each backward is multiplied by so that ZeRO's mean over dp x sp ranks sums the
    sequence-parallel shares (Note: [sequence-parallel gradients]); 1 when `sums` is False (the
    alias's DeepSpeed 0.19.8 ZeRO-3 rule, `keep_deepspeed_zero3_average`)."""
    if seq is None or cfg.gradient_allreduce_op != "mean" or not sums:
        return 1.0
    return float(seq.size)


def keep_deepspeed_zero3_average(engine: Any) -> None:
    """Under the `deepspeed` alias (it presents itself as DeepSpeed 0.19.8): at ZeRO 3, average the
    sequence-parallel ranks' gradients as DeepSpeed 0.19.8 does, because its clients compensate by
    version. Transformers' Trainer multiplies each rank's share by sp when it sees
    ``deepspeed<0.20.2`` at ZeRO 3, so summing there would give sp times the gradient (measured with
    the Trainer flow at SP 2: weights 8.2 relative off one process summing, 5e-7 averaging).
    `zeroshard.initialize` itself always sums (docs/deepspeed-differences.md)."""
    parallel = getattr(engine, "parallel", None)
    if parallel is None or parallel.sequence is None or engine.zero_optimization_stage() != 3:
        return
    parallel.sequence_sum = False
    logger.warning("sequence parallelism at ZeRO 3 through the deepspeed alias: the sequence-parallel ranks' "
                   "gradients are averaged as DeepSpeed 0.19.8 does (clients such as Transformers' Trainer scale "
                   "their loss for it); zeroshard.initialize sums them, so a loss made of each rank's share "
                   "(zeroshard.sequence.token_weighted_loss) needs zeroshard.initialize at ZeRO 3.")
