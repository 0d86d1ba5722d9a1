"""`zeroshard plan --3d`: the fastest tensor x pipeline x data-parallel layout that fits a cluster.

Every layout of the search is placed as the seed chapter (003, section 4.4) places DeepSpeed's
3D parallelism, which comm/topology.py's rank order gives by itself (rank = (pp * dp + d) * tp + t,
nodes holding consecutive ranks): tensor-parallel groups inside a node (the costliest traffic on
the fastest links; TP sizes that would cross a node are not searched), data-parallel replicas next
(inside the node while TP leaves room, else across nodes, one small group per (stage, TP rank)),
pipeline stages outermost, across nodes (the least traffic). The search enumerates TP size, PP
size, ZeRO stage, micro batch (hence the micro-batch count), schedule, sequence parallelism and
activation checkpointing; a layout fits when its fullest rank (estimate/parallel.py: states,
ZeRO buffers, the pipeline's batch buffers, activations in flight) fits the device budget. Its
step time is a sum of terms, each a plain formula printed with the choice:

- compute: 6 * params * tokens + 12 * layers * hidden * seq * tokens FLOPs (8 and 16 with
  activation checkpointing: the forward runs twice) over the ranks at `device_flops`;
- the pipeline bubble: compute (and TP traffic) times `bubble_fraction` of the schedule;
- TP: 4 all-reduces of a micro-batch's b*s*h activations per layer (6 with recompute) on the
  node's links, a ring moving 2 (t - 1) / t of the bytes;
- PP: one activation and one gradient p2p per micro-batch (and chunk) per stage boundary;
- DP / ZeRO: stage 0 all-reduces the gradient, 1 reduce-scatters it and all-gathers the
  parameters, 2 reduce-scatters every micro-batch (once per batch under a pipeline, which hands
  the batch's gradient over once), 3 also all-gathers the parameters for each micro-batch's
  forward and backward (once per batch under a pipeline); on the inter-node links when the group
  spans nodes. Not overlapped with compute (DeepSpeed's overlap_comm hides part of it): an
  upper bound, the same for every layout.

Imports `zeroshard.estimate` (and `zeroshard.errors`); never a process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from zeroshard.errors import ZeroshardError
from zeroshard.estimate.activations import ActivationOptions, bubble_fraction
from zeroshard.estimate.parallel import Layout, StageEstimate, estimate_activations, estimate_layout
from zeroshard.estimate.spec import ModelSpec
from zeroshard.estimate.states import Precision, Setup, Stage

GiB = 2**30


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The machines: nodes of identical devices, two link classes.

    Bandwidths are bytes per second per device in one direction: `intra_bandwidth` over the
    node's fabric (NVLink), `inter_bandwidth` the device's share of the node's network (a DGX
    has one 200 Gbit/s NIC per GPU: 25 GB/s).
    """

    nodes: int
    devices_per_node: int
    device_memory: int
    intra_bandwidth: float = 150e9
    inter_bandwidth: float = 25e9
    device_flops: float = 150e12
    """Achieved FLOP/s per device (about half an A100's 312 TFLOPS bf16 peak)."""
    reserve: float = 0.10

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def device_budget(self) -> int:
        return int(self.device_memory * (1 - self.reserve))


@dataclass(frozen=True, kw_only=True)
class Training:
    """What is trained: precision, sequence, global batch (sequences per optimizer step)."""

    seq_len: int
    global_batch: int
    precision: Precision = "bf16"
    optimizer_state_bytes: int = 8
    max_micro_batch: int = 8
    """Largest micro batch tried (powers of two dividing the per-replica batch)."""
    checkpointing: bool | Literal["auto"] = "auto"
    """"auto": layouts are tried with and without recompute (costing 1/3 more compute)."""
    stages: tuple[Stage, ...] = (0, 1, 2, 3)
    schedules: tuple[str, ...] = ("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble")
    tp_sizes: tuple[int, ...] | None = None
    """Only these TP sizes (None: every divisor of the node's devices that divides the heads)."""
    pp_sizes: tuple[int, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Seconds per optimizer step, by term (see the module docstring)."""

    compute: float
    bubble: float
    tp: float
    pp: float
    dp: float

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp + self.pp + self.dp


@dataclass(frozen=True, kw_only=True)
class Candidate:
    layout: Layout
    stage: Stage
    micro_batch: int
    checkpointing: bool
    memory: int
    """Device bytes of the fullest rank."""
    worst: StageEstimate
    time: StepTime
    fits: bool

    def label(self) -> str:
        ckpt = ", recompute" if self.checkpointing else ""
        return (f"{self.layout.label()}, ZeRO-{self.stage}, micro batch {self.micro_batch} x "
                f"{self.layout.micro_batches}{ckpt}")


@dataclass(frozen=True, kw_only=True)
class Plan3D:
    candidates: list[Candidate]
    """Every layout evaluated, fastest first."""
    cluster: Cluster
    training: Training
    spec: ModelSpec
    notes: list[str] = field(default_factory=list)

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.fits]

    @property
    def chosen(self) -> Candidate | None:
        fit = self.fitting
        return fit[0] if fit else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def dp_spans_nodes(layout: Layout, devices_per_node: int) -> bool:
    """Whether a data-parallel group crosses nodes: its dp ranks sit tp apart (topology order)."""
    return layout.dp > 1 and layout.dp * layout.tp > devices_per_node


def pp_spans_nodes(layout: Layout, devices_per_node: int) -> bool:
    """Whether neighbouring pipeline stages sit on different nodes (a stage is dp * tp ranks)."""
    return layout.pp > 1 and layout.dp * layout.tp >= devices_per_node


def flops_per_step(spec: ModelSpec, train: Training, checkpointing: bool) -> float:
    tokens = train.global_batch * train.seq_len
    attention = 0.0
    if spec.shape is not None:
        attention = 12 * spec.shape.num_layers * spec.shape.hidden_size * train.seq_len * tokens
    total = 6 * spec.total_params * tokens + attention
    return total * (4 / 3 if checkpointing else 1.0)


def step_time(spec: ModelSpec, train: Training, cluster: Cluster, layout: Layout, setup: Setup,
              worst: StageEstimate, micro_batch: int, checkpointing: bool) -> StepTime:
    """The step time model of the module docstring, for the fullest stage's rank."""
    compute = flops_per_step(spec, train, checkpointing) / (cluster.world_size * cluster.device_flops)
    act_bytes = 4 if train.precision == "fp32" else 2
    m = layout.micro_batches
    tp = 0.0
    if layout.tp > 1 and spec.shape is not None:
        sbh = micro_batch * train.seq_len * spec.shape.hidden_size * act_bytes
        per_layer = (6 if checkpointing else 4) * 2 * (layout.tp - 1) / layout.tp * sbh
        tp = worst.layers * m * per_layer / cluster.intra_bandwidth
    bubble = (compute + tp) * bubble_fraction(layout.schedule, layout.pp, m, layout.virtual)
    pp = 0.0
    if layout.pp > 1 and spec.shape is not None:
        sbh = micro_batch * train.seq_len * spec.shape.hidden_size * act_bytes
        bw = cluster.inter_bandwidth if pp_spans_nodes(layout, cluster.devices_per_node) else cluster.intra_bandwidth
        pp = 2 * m * layout.virtual * sbh / bw
    dp = 0.0
    d = layout.dp
    if d > 1:
        n = worst.spec.total_params
        frac = (d - 1) / d
        g, p = setup.grad_bytes, setup.param_bytes
        per_batch_grads = 1 if layout.pp > 1 else m
        volume = {0: 2 * frac * n * g,
                  1: frac * n * (g + p),
                  2: frac * n * (g * per_batch_grads + p),
                  3: frac * n * (g * per_batch_grads + 2 * p * per_batch_grads)}[setup.stage]
        bw = cluster.inter_bandwidth if dp_spans_nodes(layout, cluster.devices_per_node) else cluster.intra_bandwidth
        dp = volume / bw
    return StepTime(compute=compute, bubble=bubble, tp=tp, pp=pp, dp=dp)


def _schedules(train: Training, pp: int, layers_per_stage: float) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = []
    for s in train.schedules:
        if s.startswith("interleaved"):
            if layers_per_stage >= 2:
                out.append((s, 2))
        else:
            out.append((s, 1))
    return out


def make_3d_plan(spec: ModelSpec, train: Training, cluster: Cluster) -> Plan3D:
    """Evaluate every layout (see the module docstring); fastest fitting first.

    Raises:
        ZeroshardError: the global batch does not divide over any layout, or the spec lacks a shape.
    """
    if spec.shape is None:
        raise ZeroshardError("a 3D plan needs the model's transformer shape: give --model with a config, not --params")
    shape = spec.shape
    world, g = cluster.world_size, cluster.devices_per_node
    tps = [t for t in _divisors(g) if shape.num_heads % t == 0 and (train.tp_sizes is None or t in train.tp_sizes)]
    base = Setup(stage=0, precision=train.precision, optimizer_state_bytes=train.optimizer_state_bytes,
                 bucket_numel=int(min(5e8, max(1e6, shape.hidden_size**2))))
    act = ActivationOptions(seq_len=train.seq_len, micro_batch=1, act_bytes=4 if train.precision == "fp32" else 2)
    ckpts = (False, True) if train.checkpointing == "auto" else (bool(train.checkpointing),)
    out: list[Candidate] = []
    for tp in tps:
        for pp in _divisors(world // tp):
            if pp > shape.num_layers or (train.pp_sizes is not None and pp not in train.pp_sizes):
                continue
            dp = world // (tp * pp)
            if train.global_batch % dp:
                continue
            per_rank = train.global_batch // dp
            for stage in train.stages:
                setup = replace(base, stage=stage)
                states = estimate_layout(spec, setup, Layout(tp=tp, pp=pp, dp=dp), every_rank=False)
                for micro in (b for b in _divisors(per_rank) if b <= train.max_micro_batch and b & (b - 1) == 0):
                    m = per_rank // micro
                    for sched, v in _schedules(train, pp, states[0].layers):
                        for sp in ((False, True) if tp > 1 else (False,)):
                            layout = Layout(tp=tp, pp=pp, dp=dp, micro_batches=m, schedule=sched, virtual=v,
                                            sequence_parallel=sp)
                            for ckpt in ckpts:
                                out.append(_candidate(spec, train, cluster, layout, setup, states, micro, ckpt, act))
    if not out:
        raise ZeroshardError(f"global batch {train.global_batch} divides over no layout of {world} devices: "
                             "give a multiple of the data-parallel sizes (e.g. of the device count)")
    # Times within 0.1% are a tie: the lower ZeRO stage (less traffic per step, DeepSpeed's
    # pipelines run ZeRO-1), then the smaller memory.
    out.sort(key=lambda c: (not c.fits, float(f"{c.time.total:.3g}"), c.stage, c.memory))
    return Plan3D(candidates=out, cluster=cluster, training=train, spec=spec)


def _candidate(spec: ModelSpec, train: Training, cluster: Cluster, layout: Layout, setup: Setup,
               states: list[StageEstimate], micro: int, ckpt: bool, act: ActivationOptions) -> Candidate:
    opt = replace(act, micro_batch=micro, checkpointing=ckpt, tp=layout.tp, sequence_parallel=layout.sequence_parallel)
    peaks = [s.device_peak + estimate_activations(spec, layout, s.stage, s.layers, opt) for s in states]
    i = max(range(len(states)), key=peaks.__getitem__)
    worst = replace(states[i], activations=peaks[i] - states[i].device_peak)
    time = step_time(spec, train, cluster, layout, setup, worst, micro, ckpt)
    return Candidate(layout=layout, stage=setup.stage, micro_batch=micro, checkpointing=ckpt,
                     memory=peaks[i], worst=worst, time=time, fits=peaks[i] <= cluster.device_budget)
