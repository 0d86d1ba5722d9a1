"""zeroshard's model-state memory, per rank and per node, for every stage and offload setting.

The arithmetic mirrors what the strategies allocate (zero/stage0.py, zero/stage12.py) so that
`estimate_rank(...)` equals `engine.model_state_bytes()` category by category; see
docs/estimate.md for the formulas and how they differ from DeepSpeed's. Stage 3 is a
prediction from the design (sharded parameters gathered per unit) until the engine has it.
Imports `zeroshard.config` (a `Setup` is read from a `Config`), `estimate.spec`, `zeroshard.zero.flat`
(the exact bucket padding) and `zeroshard.zero.schedule` (which stage-3 units stay gathered); never a
process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from zeroshard.errors import ZeroshardError
from zeroshard.zero.flat import BucketedPartition, FlatLayout
from zeroshard.zero.schedule import gathered_after_forward

if TYPE_CHECKING:
    from zeroshard.config import Config
    from zeroshard.estimate.spec import ModelSpec

Precision = Literal["fp32", "bf16", "fp16"]
ZeroStage = Literal[0, 1, 2, 3]
Device = Literal["none", "cpu", "nvme"]

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
ALIGN_NUMEL = 16
"""Stages 1-2 pad each rank's chunk of every bucket to 16 elements (zero/stage12.py)."""
MASTER_BYTES = 4
"""fp32 master weights."""

OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adam": 8, "adamw": 8, "lamb": 8, "adamax": 8, "nadam": 8, "radam": 8, "adadelta": 8,
    "adagrad": 4, "rmsprop": 4, "sgd": 4, "asgd": 4, "rprop": 8,
}
"""fp32 bytes of optimizer state per parameter element (Adam: exp_avg + exp_avg_sq). SGD counts
its momentum buffer; scalar states (Adam's step) are not counted, as the engine does not."""


def optimizer_state_bytes_per_param(name: str, amsgrad: bool = False) -> int:
    """Bytes of state per element for an optimizer type (8 for Adam; +4 with amsgrad)."""
    base = OPTIMIZER_STATE_BYTES.get(name.lower(), 8)
    return base + (4 if amsgrad and name.lower() in ("adam", "adamw") else 0)


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One training setup: what the estimator needs from a ds_config and the hardware.

    Build it from a loaded config with `Setup.from_config(cfg, ...)`, or directly.
    """

    zero_stage: ZeroStage
    offload_optimizer: Device = "none"
    offload_param: Device = "none"
    precision: Precision = "bf16"
    grad_accum_dtype: Precision | None = None
    """None: fp32 (zeroshard accumulates gradients in fp32 by default, also under bf16/fp16)."""
    bf16_masters: bool = False
    """`bf16.bf16_master_weights_and_grads` (+ `bf16_optimizer_states`): master shard, gradients and
    optimizer states in bf16 (`optimizer_state_bytes` is then already the bf16 figure)."""
    optimizer_state_bytes: int = 8
    bucket_numel: int = 500_000_000
    """Stages 1-2: min(reduce_bucket_size, allgather_bucket_size); stage 0: reduce_bucket_size."""
    overlap_comm: bool = False
    param_persistence_threshold: int = 100_000
    """Stage 3: parameters smaller than this stay gathered on every rank."""
    prefetch_numel: int = 50_000_000
    """Stage 3: elements gathered ahead of use (`stage3_prefetch_bucket_size`)."""
    max_reuse_numel: int = 1_000_000_000
    """Stage 3: a unit used again within this many elements stays gathered, through backward
    (`stage3_max_reuse_distance`)."""
    sub_group_size: int = 1_000_000_000
    nvme_buffer_count: int = 4
    """offload_optimizer.buffer_count: slots of three sub-group sized fp32 buffers in CPU memory (NVMe)."""
    param_buffer_count: int = 5
    param_buffer_size: int = 100_000_000
    devices_per_node: int = 1
    nodes: int = 1
    zero_init: bool = False
    """Stage 3: the model is built partitioned (zero.Init), so no rank ever holds it whole."""

    def __post_init__(self) -> None:
        if self.devices_per_node < 1 or self.nodes < 1:
            raise ZeroshardError(f"devices per node ({self.devices_per_node}) and nodes ({self.nodes}) must be >= 1")
        if self.zero_stage < 3 and self.offload_param != "none":
            raise ZeroshardError(f"offload_param needs stage 3 (got stage {self.zero_stage})")
        if self.zero_stage == 0 and self.offload_optimizer != "none":
            raise ZeroshardError("offload_optimizer needs stage 1, 2 or 3")

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.precision]

    @property
    def grad_bytes(self) -> int:
        return DTYPE_BYTES["bf16" if self.bf16_masters else self.grad_accum_dtype or "fp32"]

    @property
    def master_bytes(self) -> int:
        return DTYPE_BYTES["bf16"] if self.bf16_masters else MASTER_BYTES

    @property
    def master_is_params(self) -> bool:
        """Without offload, a master of the parameters' dtype is the parameters (zero/shard.py)."""
        return self.master_bytes == self.param_bytes

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    def label(self) -> str:
        parts = [f"stage {self.zero_stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"offload_optimizer={self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"offload_param={self.offload_param}")
        return " + ".join(parts)

    @classmethod
    def from_config(cls, cfg: "Config", *, devices_per_node: int = 1, nodes: int = 1) -> "Setup":
        """The setup a loaded ds_config describes (stage, offloads, dtypes, buckets, optimizer)."""
        zero = cfg.zero_optimization
        opt = cfg.optimizer
        amsgrad = bool(getattr(opt.params, "amsgrad", False)) if opt is not None else False
        bucket = int(zero.reduce_bucket_size)
        if zero.stage in (1, 2):
            bucket = min(bucket, int(zero.allgather_bucket_size))
        bf16_masters = cfg.bf16.bf16_master_weights_and_grads and cfg.bf16.bf16_optimizer_states
        state_bytes = optimizer_state_bytes_per_param(opt.type if opt else "adamw", amsgrad)
        return cls(
            zero_stage=zero.stage, offload_optimizer=zero.offload_optimizer.device, bf16_masters=bf16_masters,
            # offload_param below stage 3 is accepted with a note and has no effect (config/zero_stages.py)
            offload_param=zero.offload_param.device if zero.stage == 3 else "none", precision=cfg.precision,
            grad_accum_dtype=cfg.data_types.grad_accum_dtype,
            optimizer_state_bytes=state_bytes // 2 if bf16_masters else state_bytes,
            bucket_numel=max(1, bucket), overlap_comm=bool(zero.overlap_comm),
            param_persistence_threshold=int(zero.stage3_param_persistence_threshold),
            prefetch_numel=int(zero.stage3_prefetch_bucket_size),
            max_reuse_numel=int(zero.stage3_max_reuse_distance),
            sub_group_size=int(zero.sub_group_size), nvme_buffer_count=int(zero.offload_optimizer.buffer_count),
            param_buffer_count=int(zero.offload_param.buffer_count),
            param_buffer_size=int(zero.offload_param.buffer_size),
            devices_per_node=devices_per_node, nodes=nodes)


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Bytes of model states in one home, by category (as `zero.strategy.ModelStateBytes`)."""

    params: int = 0
    grads: int = 0
    master_params: int = 0
    optimizer_states: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master_params + self.optimizer_states


@dataclass(frozen=True, slots=True)
class RankEstimate:
    """What one rank holds.

    Attributes:
        device: model states on the accelerator (the CPU when there is none).
        host: model states offloaded to CPU memory.
        nvme: model states in NVMe swap files.
        device_buffers: transient device memory of the step: stage-2 gradient staging
            buckets, stage-3 gathered units.
        host_buffers: CPU buffers for NVMe swapping.
        init_host: CPU bytes while the model is built (fp32, whole; one layer with zero.Init).
        staging_pool: device bytes of gradient staging blocks the reducer keeps for reuse
            between steps (stages 2 and 3; part of `device_buffers`, but still held after the
            step: zero/reduce.py pools them by size).
    """

    device: StateBytes
    host: StateBytes
    nvme: StateBytes
    device_buffers: int
    host_buffers: int
    init_host: int
    staging_pool: int = 0

    @property
    def device_peak(self) -> int:
        return self.device.total + self.device_buffers

    @property
    def host_peak(self) -> int:
        return max(self.host.total + self.host_buffers, self.init_host)


@dataclass(frozen=True)
class _Layout:
    padded_numel: int
    shard_numel: int
    owned_numel: int
    bucket_padded: tuple[int, ...]
    """Padded elements of each gradient bucket (the stage-2 staging sizes)."""


def _partition_layout(spec: "ModelSpec", setup: Setup, rank: int) -> _Layout:
    """Stages 1-2 flat layout: exact from the parameter sizes, else bounded from the count."""
    world = setup.world_size
    if spec.param_numels is not None:
        # The strategy packs parameters in backward (reversed) order, bucket by bucket.
        plan = BucketedPartition(list(reversed(spec.param_numels)), bucket_numel=setup.bucket_numel,
                                 world_size=world, align=ALIGN_NUMEL)
        owned = sum(f.numel for f in plan.rank_fragments(rank))
        return _Layout(plan.padded_numel, plan.shard_numel, owned, tuple(lay.padded_numel for lay in plan.layouts))
    # Counts only: at most one aligned pad per bucket (the conservative end of the range).
    phi = spec.total_params
    buckets = max(1, math.ceil(phi / setup.bucket_numel))
    chunk = world * ALIGN_NUMEL
    padded = phi + buckets * chunk
    padded -= padded % chunk
    tail = phi % setup.bucket_numel
    sizes = [setup.bucket_numel] * (phi // setup.bucket_numel) + ([tail] if tail else [])
    return _Layout(padded, padded // world, math.ceil(phi / world), tuple(n + chunk for n in sizes))


@dataclass(frozen=True)
class _Stage3Layout:
    persistent_padded: int
    """Elements of the persistent unit's flat buffer, whole on every rank."""
    shard_numel: int
    owned_numel: int
    unit_padded: tuple[int, ...]
    """Padded elements of each gathered (non-persistent) unit."""


def _zero_stage3_layout(spec: "ModelSpec", setup: Setup, rank: int) -> _Stage3Layout:
    """Stage 3 as zero/stage3.py lays it out: each unit one flat buffer split evenly over the
    ranks (16-element aligned chunks); parameters under the persistence threshold move to one
    last, persistent unit that stays gathered (and is sharded too, for the optimizer)."""
    world, thr = setup.world_size, setup.param_persistence_threshold
    if spec.unit_params is None:  # counts only: one unit, no small parameters known
        chunk = world * ALIGN_NUMEL
        shard = math.ceil(spec.total_params / chunk) * ALIGN_NUMEL + ALIGN_NUMEL
        return _Stage3Layout(chunk, shard, math.ceil(spec.total_params / world),
                             (spec.largest_layer_params,))
    groups = [[n for n in unit if n >= thr] for unit in spec.unit_params]
    groups.append([n for unit in spec.unit_params for n in unit if n < thr])
    layouts = [FlatLayout(tuple(g), world, ALIGN_NUMEL) for g in groups]
    owned = sum(f.numel for lay in layouts for f in lay.rank_fragments(rank))
    return _Stage3Layout(layouts[-1].padded_numel, sum(lay.partition_numel for lay in layouts), owned,
                         tuple(lay.padded_numel for lay in layouts[:-1]))


def estimate_rank(spec: "ModelSpec", setup: Setup, rank: int = 0) -> RankEstimate:
    """Model-state bytes rank `rank` holds under `setup` (zeroshard's accounting).

    Stages 0-2 reproduce the engine's allocations exactly when `spec` has every parameter's
    size (a live or meta-built module); from counts alone, padding is bounded (< 0.01% for
    real models). Stage 3 follows the design and is checked once the engine has it.

    Example:
        >>> from zeroshard.estimate.spec import spec_from_counts
        >>> r = estimate_rank(spec_from_counts(1e9), Setup(zero_stage=0, precision="bf16"))
        >>> r.device.total // 10**9   # 2 (bf16) + 4 (fp32 grads) + 4 (master) + 8 (Adam)
        18
    """
    if not 0 <= rank < setup.world_size:
        raise ZeroshardError(f"rank {rank} outside world size {setup.world_size}")
    if setup.zero_stage == 0:
        return _zero_stage0(spec, setup)
    if setup.zero_stage in (1, 2):
        return _zero_stage12(spec, setup, rank)
    return _zero_stage3(spec, setup, rank)


def _init_host(spec: "ModelSpec", setup: Setup) -> int:
    # Each rank builds the model in fp32 on the CPU before moving it (4 bytes per element).
    if setup.zero_stage == 3 and setup.zero_init:
        return 4 * spec.largest_layer_params
    return 4 * spec.total_params


def _zero_stage0(spec: "ModelSpec", setup: Setup) -> RankEstimate:
    phi = spec.total_params
    device = StateBytes(params=setup.param_bytes * phi, grads=setup.grad_bytes * phi,
                        master_params=MASTER_BYTES * phi if setup.mixed else 0,
                        optimizer_states=setup.optimizer_state_bytes * phi)
    return RankEstimate(device, StateBytes(), StateBytes(), 0, 0, _init_host(spec, setup))


def _zero_stage12(spec: "ModelSpec", setup: Setup, rank: int) -> RankEstimate:
    lay = _partition_layout(spec, setup, rank)
    nvme = setup.offload_optimizer == "nvme"
    offload = setup.offload_optimizer == "cpu" or nvme
    g = setup.grad_bytes
    full_grad = g * lay.padded_numel if setup.zero_stage == 1 else 0
    # The gradient shard exists at stage 2, and at stage 1 only with offload (a CPU copy of
    # the reduced chunk); stage 1 otherwise reads its chunk in place in the whole gradient.
    shard_grad = g * lay.shard_numel if (setup.zero_stage == 2 or offload) else 0
    # fp32 master shard when the model is 16-bit, or when it must live apart on the CPU;
    # fp32 training without offload steps on the flat buffer itself (no second copy).
    master = setup.master_bytes * lay.shard_numel if (not setup.master_is_params or offload) else 0
    opt = setup.optimizer_state_bytes * lay.owned_numel
    params = setup.param_bytes * lay.padded_numel
    swapped = StateBytes()
    if nvme:
        # the fp32 master and the optimizer states live in the swap files; in fp32 training the
        # model's own weights are the fragments the step writes back to (zero/shard.py)
        device = StateBytes(params=params, grads=full_grad)
        host = StateBytes(grads=shard_grad)
        swapped = StateBytes(master_params=MASTER_BYTES * lay.shard_numel, optimizer_states=opt)
    elif offload:
        device = StateBytes(params=params, grads=full_grad)
        host = StateBytes(grads=shard_grad, master_params=master, optimizer_states=opt)
    else:
        device = StateBytes(params=params, grads=full_grad + shard_grad, master_params=master,
                            optimizer_states=opt)
        host = StateBytes()
    buffers = 0
    if setup.zero_stage == 2:
        # Staging: the bucket being filled plus those in flight (two with overlap_comm, see
        # MAX_BUCKETS_IN_FLIGHT in zero/reduce.py); the pool keeps them after the step.
        # Blocks are all of the largest bucket's size, so similar buckets share them.
        buffers = g * max(lay.bucket_padded) * min(len(lay.bucket_padded), 3 if setup.overlap_comm else 1)
    pool = nvme_pool_bytes(setup, lay.shard_numel) if nvme else 0
    return RankEstimate(device, host, swapped, buffers, pool, _init_host(spec, setup), buffers)


def _staging_pool(sizes: tuple[int, ...], overlap_comm: bool) -> int:
    """Elements of the staging blocks pooled by size (stage 3's units) when buckets of `sizes`
    (in launch order) are staged one after another: the one filling plus two still in flight."""
    window = 3 if overlap_comm else 1
    most: dict[int, int] = {}
    for start in range(max(1, len(sizes) - window + 1)):
        counts: dict[int, int] = {}
        for n in sizes[start : start + window]:
            counts[n] = counts.get(n, 0) + 1
        for n, c in counts.items():
            most[n] = max(most.get(n, 0), c)
    return sum(n * c for n, c in most.items())


def nvme_pool_bytes(setup: Setup, shard_numel: int) -> int:
    """Host memory of the NVMe optimizer swap pool (zero/offload/nvme_swap.py, Note: [swap pipeline]):
    `buffer_count` slots (at least 3, at most one per sub-group) of three fp32 states of one
    sub-group each."""
    group = max(1, min(setup.sub_group_size, shard_numel))
    slots = min(max(3, setup.nvme_buffer_count), -(-shard_numel // group))
    return slots * 3 * group * 4


def _zero_stage3(spec: "ModelSpec", setup: Setup, rank: int) -> RankEstimate:
    lay = _zero_stage3_layout(spec, setup, rank)
    p, g = setup.param_bytes, setup.grad_bytes
    separate_master = (not setup.master_is_params or setup.offload_optimizer != "none"
                       or setup.offload_param != "none")
    homes = {"none": StateBytes(params=p * lay.persistent_padded), "cpu": StateBytes(), "nvme": StateBytes()}
    homes[setup.offload_param] = _add(homes[setup.offload_param], StateBytes(params=p * lay.shard_numel))
    homes[setup.offload_optimizer] = _add(homes[setup.offload_optimizer], StateBytes(
        grads=g * lay.shard_numel, master_params=setup.master_bytes * lay.shard_numel if separate_master else 0,
        optimizer_states=setup.optimizer_state_bytes * lay.owned_numel))
    # Working set: the unit computing plus the next one prefetched, or, larger, the units kept
    # gathered from their forward to their backward (`stage3_max_reuse_distance`) plus the first
    # released one backward prefetches; and the gradient staging of the unit just finished plus
    # those still reducing (two in flight with overlap_comm).
    units = sorted(lay.unit_padded, reverse=True) or [0]
    kept = gathered_after_forward(lay.unit_padded, setup.max_reuse_numel)
    released = sum(lay.unit_padded) - kept
    gathered = max(units[0] + min(sum(units[1:2]), setup.prefetch_numel),
                   kept + (min(units[0], setup.prefetch_numel) if released else 0))
    # Staging: the root unit and the persistent one collect gradients from the first to the
    # last of backward; the other units are staged one after another (zero/reduce.py's pool).
    root, others = (lay.unit_padded[0], lay.unit_padded[1:]) if lay.unit_padded else (0, ())
    pool = g * (root + lay.persistent_padded + _staging_pool(tuple(reversed(others)), setup.overlap_comm))
    buffers = p * gathered + pool
    host_buffers = 0
    if setup.offload_optimizer == "nvme":
        host_buffers += nvme_pool_bytes(setup, lay.shard_numel)
    if setup.offload_param == "nvme":
        host_buffers += setup.param_buffer_count * setup.param_buffer_size * p
    return RankEstimate(homes["none"], homes["cpu"], homes["nvme"], buffers, host_buffers,
                        _init_host(spec, setup), pool)


def _add(a: StateBytes, b: StateBytes) -> StateBytes:
    return StateBytes(a.params + b.params, a.grads + b.grads, a.master_params + b.master_params,
                      a.optimizer_states + b.optimizer_states)


@dataclass(frozen=True, slots=True)
class NodeEstimate:
    """The figures a table or a plan needs for one setup.

    Attributes:
        device_states: model states on the fullest device (max over ranks).
        device_peak: states plus the step's transient buffers on that device.
        cpu_steady: offloaded states plus NVMe swap buffers in one node's CPU memory.
        cpu_init: the fp32 model every local rank builds on the CPU at start-up.
        nvme: bytes in NVMe swap files per node.
        nvme_params: of which parameters (read in forward and backward, unlike the rest).
    """

    setup: Setup
    device_states: int
    device_peak: int
    cpu_steady: int
    cpu_init: int
    nvme: int
    nvme_params: int = 0

    @property
    def cpu_peak(self) -> int:
        """CPU memory one node needs: the larger of start-up and steady state."""
        return max(self.cpu_steady, self.cpu_init)


def estimate_node(spec: "ModelSpec", setup: Setup) -> NodeEstimate:
    """Per device (the fullest rank) and per node (all its ranks) figures for `setup`."""
    exact = setup.zero_stage > 0 and spec.param_numels is not None and setup.world_size <= 64
    ests = [estimate_rank(spec, setup, r) for r in (range(setup.world_size) if exact else [0])]
    worst_dev = max(ests, key=lambda e: e.device_peak)
    local = setup.devices_per_node
    return NodeEstimate(
        setup=setup, device_states=worst_dev.device.total, device_peak=worst_dev.device_peak,
        cpu_steady=local * max(e.host.total + e.host_buffers for e in ests),
        cpu_init=local * ests[0].init_host, nvme=local * max(e.nvme.total for e in ests),
        nvme_params=local * max(e.nvme.params for e in ests))
