"""Every parallel dimension of a job, decided in one place: pipeline (pp), data (dp, with ZeRO++
hpZ's replicate x shard split), tensor (tp), expert (ep) and sequence (sp).

:func:`resolve_dims` is a pure function of integers (no process group, no module): the world size
and what each source asks for (the config's parallel sizes read before parsing, a recorded
``tp_model_init``, a ``PipelineModule``'s topology, an ``mpu``'s sizes) in, one frozen
:class:`ParallelDims` out, or an error that names the sources that disagree and how to fix them.
``initialize`` calls it once; the process groups (comm/topology.py's mesh), the batch triad's
rank count, the pipeline module's 3D topology and the checkpointer's piece count all read it.

Where ``ep`` and ``sp`` sit (DeepSpeed's layouts, which torchtitan's ``ParallelDims`` shares):
both subdivide the ranks that are not pipeline or tensor-parallel ranks. An expert-parallel group
is ``ep`` consecutive data-parallel ranks, and an expert's gradients are reduced over the
``dp / ep`` ranks holding the same expert (the expert-data-parallel group). A sequence-parallel
group is ``sp`` consecutive ranks sharing one sample, so the batch is split over ``dp`` =
world / (pp x tp x sp) ranks while ZeRO partitions and reduces over the dp x sp ranks of the
mesh's data axis (the sequence-data-parallel group). Both are validated here; ``ep`` is the largest
expert-parallel size of the model's MoE layers (``initialize`` reads it from the model), ``sp`` the
config's ``sequence_parallel_size`` or an ALST mpu's.

Imports `comm.topology` and `errors` only; never a process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from zeroshard.comm.topology import Topology
from zeroshard.errors import ConfigError, NotSupportedError


@dataclass(frozen=True)
class PipeShape:
    """A PipelineModule's topology: its stages and its model (tensor-parallel) axis, which is more
    than 1 when the script split its own layers (Megatron's layers in DeepSpeed's 3D)."""

    pp: int
    model_axis: int = 1


@dataclass(frozen=True)
class MpuShape:
    """A Megatron-style mpu's sizes (`get_model_parallel_world_size`, `get_data_parallel_world_size`)."""

    model_parallel: int
    data_parallel: int


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of every dimension of one job and who asked for them.

    >>> d = resolve_dims(8, config_tp=2, pipe=PipeShape(pp=2))
    >>> (d.pp, d.dp, d.tp, d.ep, d.sp), d.tp_split, d.batch_world_sizes
    ((2, 2, 2, 1, 1), 'autotp', (2, 8))
    >>> d.topology
    Topology(pp=2, dp=2, tp=2)
    """

    world_size: int
    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    sp: int = 1
    dp_shard: int = 1
    """ZeRO++ hpZ: the data-parallel ranks that hold one secondary copy (1: no split)."""
    tp_split: str | None = None
    """Who splits the tensor-parallel layers: "autotp" (zeroshard, from the config or tp_model_init),
    "script" (the script's own Megatron-style layers: an mpu or a PipelineModule's model axis), or
    None without tensor parallelism."""
    from_mpu: bool = False
    """The data- and model-parallel groups are an mpu's, not zeroshard's mesh."""
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    """(dimension, what set it) for every dimension larger than 1, for messages and logs."""

    def __post_init__(self) -> None:
        for name in ("world_size", "pp", "dp", "tp", "ep", "sp", "dp_shard"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"ParallelDims.{name}: expected a positive integer, got {size!r}")
        if self.pp * self.dp * self.tp * self.sp != self.world_size:
            raise ValueError(f"{self}: pp x dp x tp x sp must be the world size")
        if self.dp % self.ep or self.dp % self.dp_shard:
            raise ValueError(f"{self}: ep and dp_shard must divide dp")

    @property
    def topology(self) -> Topology:
        """The (pp, dp, tp) rank grid the mesh is built on (ep and sp subdivide its dp axis)."""
        return Topology(pp=self.pp, dp=self.dp * self.sp, tp=self.tp)

    @property
    def expert_dp(self) -> int:
        """The ranks an expert's gradients are reduced over: dp / ep."""
        return self.dp // self.ep

    def expert_rank_lists(self, data_before_expert: bool = False) -> tuple[list[list[int]], list[list[int]]]:
        """(expert-parallel groups, expert-data-parallel groups), as positions in the data-parallel
        group: blocks of ``ep`` consecutive positions split one layer's experts, and the positions
        at the same place in every block hold the same experts (DeepSpeed 0.19.8's layout).
        `data_before_expert` (DeepSpeed's ``use_data_before_expert_parallel_``) strides the
        expert-parallel groups instead.

        >>> ParallelDims(world_size=4, dp=4, ep=2).expert_rank_lists()
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
        >>> ParallelDims(world_size=4, dp=4, ep=2).expert_rank_lists(data_before_expert=True)
        ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
        """
        if data_before_expert:
            stride = self.dp // self.ep
            order = [r for start in range(stride) for r in range(start, self.dp, stride)]
        else:
            order = list(range(self.dp))
        ep_groups = [order[i:i + self.ep] for i in range(0, self.dp, self.ep)]
        return ep_groups, [list(ranks) for ranks in zip(*ep_groups)]

    def sequence_rank_lists(self) -> tuple[list[list[int]], list[list[int]]]:
        """(sequence-parallel groups, data-parallel groups), as positions in the mesh's data axis
        (its dp x sp ranks, ZeRO's group): blocks of ``sp`` consecutive positions share one sample
        (DeepSpeed's ``parallel_state_sp`` layout), and the positions at the same place in every
        block are the data-parallel ranks the batch is split over.

        >>> ParallelDims(world_size=4, dp=2, sp=2).sequence_rank_lists()
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
        """
        width = self.dp * self.sp
        sp_groups = [list(range(i, i + self.sp)) for i in range(0, width, self.sp)]
        return sp_groups, [list(ranks) for ranks in zip(*sp_groups)]

    @property
    def dp_replicate(self) -> int:
        """hpZ: how many secondary copies of the parameters the data-parallel ranks hold."""
        return self.dp // self.dp_shard

    @property
    def batch_world_sizes(self) -> tuple[int, ...]:
        """The rank counts the config's batch triad may be written for, preferred first: the
        data-parallel ranks; with AutoTP and no mpu also every rank (DeepSpeed 0.19.8's count when
        it sees no data-parallel group, which Hugging Face's Trainer fills "auto" with)."""
        if self.tp_split == "autotp" and self.world_size != self.dp:
            return (self.dp, self.world_size)
        return (self.dp,)

    def with_hpz(self, size: int, ranks_per_node: int | None = None) -> ParallelDims:
        """These dims with ZeRO++ hpZ's shard of `size` data-parallel ranks (0 and 1: off), read from
        the parsed config after the sizes the batch triad needed; with `ranks_per_node` (the
        launcher's local world size) the shard must also be one node's data-parallel ranks, where
        the secondary copy's all-gathers stay inside the node.

        Raises:
            ConfigError: `size` does not divide the data-parallel size, or is not the ranks per node.

        >>> resolve_dims(8).with_hpz(4, ranks_per_node=4).dp_replicate
        2
        >>> resolve_dims(8).with_hpz(2, ranks_per_node=4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        zeroshard.errors.ConfigError: zero_optimization.zero_hpz_partition_size: got 2, but it must divide ...
        """
        shard = size if size > 1 else 1
        if shard > 1 and self.sp > 1:
            raise NotSupportedError(f"zero_optimization.zero_hpz_partition_size {size} together with sequence "
                                    f"parallelism (size {self.sp}) is not implemented: set zero_hpz_partition_size "
                                    "to 1.")
        node = None if ranks_per_node is None else max(1, min(ranks_per_node, self.dp))
        if self.dp % shard or (shard > 1 and node is not None and shard != node):
            fix = (f"Set it to {node}{'' if self.dp % node == 0 else ' (after fixing the layout)'}"
                   if node is not None else "Set it to a divisor (the ranks per node)")
            raise ConfigError(
                f"zero_optimization.zero_hpz_partition_size: got {size}, but it must divide the data-parallel "
                f"world size ({self.dp})" + ("" if node is None else
                                             f" and equal the ranks per node ({node}: the launcher's LOCAL_WORLD_SIZE, "
                                             "or ZEROSHARD_NODE_SIZE)") + f". {fix}, or to 1 to turn hpZ off.")
        return replace(self, dp_shard=shard)

    def describe(self) -> str:
        """One line for the start-up log: every size, and who asked for those above 1."""
        sizes = " x ".join(f"{n} {getattr(self, n)}" for n in ("pp", "dp", "tp", "ep", "sp"))
        why = "; ".join(f"{d} from {s}" for d, s in self.sources)
        return f"{sizes} = {self.world_size} rank(s)" + (f" ({why})" if why else "")


def resolve_dims(world_size: int, *, config_tp: int = 1, recorded_tp: int = 1, pipe: PipeShape | None = None,
                 mpu: MpuShape | None = None, ep: int = 1, sp: int = 1, hpz: int = 1) -> ParallelDims:
    """Decide every dimension of a `world_size`-rank job from what each source asks for.

    Args:
        config_tp: the config's `tensor_parallel` size (1 without the section).
        recorded_tp: what `tp_model_init(model, tp_size=...)` recorded (1 when not called).
        pipe: the PipelineModule's topology, when the model is one.
        mpu: an mpu's sizes, when initialize() got one.
        ep: the expert-parallel size (1 until expert parallelism is built).
        sp: the sequence-parallel size (the config's ``sequence_parallel_size`` or an ALST mpu's).
        hpz: `zero_optimization.zero_hpz_partition_size` (0 and 1: off).

    Raises:
        ConfigError: sizes that do not fit the world or disagree, naming both sources and a fix.
        NotSupportedError: an mpu together with AutoTP or a PipelineModule.

    >>> resolve_dims(4, mpu=MpuShape(model_parallel=2, data_parallel=2)).tp_split
    'script'
    >>> resolve_dims(4, config_tp=2, recorded_tp=4)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    zeroshard.errors.ConfigError: tp_model_init(tp_size=4) and tensor_parallel.autotp_size (2) disagree; ...
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size: got {world_size!r}, expected an integer >= 1")
    if config_tp > 1 and recorded_tp > 1 and config_tp != recorded_tp:
        raise ConfigError(f"tp_model_init(tp_size={recorded_tp}) and tensor_parallel.autotp_size ({config_tp}) "
                          "disagree; make them equal (or drop one).")
    autotp = max(config_tp, recorded_tp)
    sources = []
    if autotp > 1:
        sources.append(("tp", "tensor_parallel.autotp_size" if config_tp > 1 else "tp_model_init"))
    if mpu is not None:
        return _from_mpu(world_size, mpu, autotp, pipe, ep, sp, hpz, sources)
    pp, tp, split = 1, autotp, "autotp" if autotp > 1 else None
    if pipe is not None:
        pp = pipe.pp
        if pp > 1:
            sources.append(("pp", "the PipelineModule's topology"))
        if pipe.model_axis > 1:
            if autotp > 1 and autotp != pipe.model_axis:
                raise ConfigError(
                    f"the PipelineModule's topology has a model (tensor-parallel) axis of {pipe.model_axis}, but the "
                    f"tensor-parallel size is {autotp}; make tensor_parallel.autotp_size equal num_mp, or build the "
                    "PipelineModule with num_stages= / a PipeDataParallelTopology.")
            if autotp == 1:  # the script split its own layers (Megatron's in DeepSpeed's 3D)
                tp, split = pipe.model_axis, "script"
                sources.append(("tp", "the PipelineModule's topology (num_mp)"))
    if world_size % (pp * tp * sp):
        what = " x ".join(f"{n} {s}" for n, s in (("pipeline size", pp), ("tensor-parallel size", tp),
                                                  ("sequence-parallel size", sp)) if s > 1)
        raise ConfigError(
            f"a world of {world_size} ranks cannot hold {what or 'this layout'}: their product ({pp * tp * sp}) must "
            f"divide the world size; start a multiple of {pp * tp * sp} ranks or change the sizes.")
    dp = world_size // (pp * tp * sp)
    return _finish(ParallelDims, world_size=world_size, pp=pp, dp=dp, tp=tp, ep=ep, sp=sp, hpz=hpz,
                   tp_split=split, sources=sources)


def _from_mpu(world_size: int, mpu: MpuShape, autotp: int, pipe: PipeShape | None, ep: int, sp: int, hpz: int,
              sources: list[tuple[str, str]]) -> ParallelDims:
    if autotp > 1:
        raise NotSupportedError(
            "not supported yet: initialize(mpu=...) together with tensor_parallel (AutoTP over an mpu's "
            "groups); drop mpu= to let zeroshard build the groups, or drop the tensor_parallel section.")
    if pipe is not None:
        raise NotSupportedError(
            "not supported: a PipelineModule together with mpu= (DeepSpeed refuses it too); drop mpu= and give "
            "the PipelineModule topology=PipeModelDataParallelTopology(num_pp, num_mp, num_dp) for Megatron-style "
            "layers (split parameters marked tensor_model_parallel = True), or let AutoTP split the stages "
            "(tensor_parallel.autotp_size with a preset_model or partition_config).")
    tp, dp = mpu.model_parallel, mpu.data_parallel
    if tp < 1 or dp < 1 or tp * dp * sp != world_size:
        raise ConfigError(f"initialize(mpu=...): model-parallel size {tp} x data-parallel size {dp} "
                          f"!= world size {world_size}; the mpu's groups must cover every rank once.")
    if tp > 1:
        sources.append(("tp", "the mpu"))
    return _finish(ParallelDims, world_size=world_size, pp=1, dp=dp, tp=tp, ep=ep, sp=sp, hpz=hpz,
                   tp_split="script" if tp > 1 else None, from_mpu=True, sources=sources)


def _finish(cls: type[ParallelDims], *, dp: int, ep: int, sp: int, hpz: int, sources: list[tuple[str, str]],
            **sizes: object) -> ParallelDims:
    """Validate the slots that subdivide dp (ep, the hpZ shard) and build the frozen description."""
    for name, size in (("expert-parallel size", ep), ("sequence-parallel size", sp)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"{name}: got {size!r}, expected an integer >= 1")
    if dp % ep:
        raise ConfigError(f"the expert-parallel size {ep} must divide the data-parallel size {dp} (expert-parallel "
                          "groups are made of data-parallel ranks); choose an ep that divides it.")
    if ep > 1:
        sources.append(("ep", "the expert-parallel size"))
    if sp > 1 and ep > 1:
        raise NotSupportedError(f"sequence parallelism (size {sp}) together with MoE expert parallelism (ep_size {ep}) "
                                "is not implemented: set sequence_parallel_size to 1, or the MoE layers' ep_size to 1.")
    if sp > 1:
        sources.append(("sp", "the sequence-parallel size"))
    return cls(dp=dp, ep=ep, sp=sp, sources=tuple(sources), **sizes).with_hpz(hpz)  # type: ignore[arg-type]
