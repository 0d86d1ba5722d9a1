"""`zeroshard plan --3d`: the fastest tensor x pipeline x data-parallel layout that fits a cluster.

Every layout of the search is placed as the seed chapter (003, section 4.4) places DeepSpeed's
3D parallelism, which comm/topology.py's rank order gives by itself (rank = (pp * dp + d) * tp + t,
nodes holding consecutive ranks): tensor-parallel groups inside a node (the costliest traffic on
the fastest links; TP sizes that would cross a node are not searched), data-parallel replicas next
(inside the node while TP leaves room, else across nodes, one small group per (stage, TP rank)),
pipeline stages outermost, across nodes (the least traffic). The search enumerates TP size, PP
size, ZeRO stage, micro batch (hence the micro-batch count), schedule, sequence parallelism and
activation checkpointing, and for a model with expert banks (`spec.experts`) the expert-parallel
size: every divisor of DP that divides the expert count, beside every TP and PP size (the engine
makes expert groups inside each (stage, TP rank)'s data-parallel ranks, estimate/parallel.py): an
EP group is EP consecutive data-parallel ranks of one (stage, TP rank), so TP ranks apart, an
expert's expert-data-parallel group the DP / EP ranks one every EP of them. A layout fits when its fullest rank
(estimate/parallel.py: states, ZeRO buffers, the pipeline's batch buffers, activations in flight)
fits the device budget. Its step time is a sum of terms, each a plain formula printed with the
choice:

- compute: 6 * params * tokens + 12 * layers * hidden * seq * tokens FLOPs (8 and 16 with
  activation checkpointing: the forward runs twice) over the ranks at `device_flops`; for a MoE
  model `params` is the active count (dense + top_k / num_experts of the experts: a token goes
  through top_k experts), the same at every EP size;
- the pipeline bubble: compute (and TP traffic) times `bubble_fraction` of the schedule;
- TP: 4 all-reduces of a micro-batch's b*s*h activations per layer (6 with recompute) on the
  node's links, a ring moving 2 (t - 1) / t of the bytes;
- PP: one activation and one gradient p2p per micro-batch (and chunk) per stage boundary;
- DP / ZeRO: ZeRO stage 0 all-reduces the gradient, 1 reduce-scatters it and all-gathers the
  parameters, 2 reduce-scatters every micro-batch (once per batch under a pipeline, which hands
  the batch's gradient over once), 3 also all-gathers the parameters for each micro-batch's
  forward and backward (once per batch under a pipeline); on the inter-node links when the group
  spans nodes. With EP > 1 the rank's dense share pays that over DP and its experts (its
  stage's expert params / EP) over the expert-data-parallel group of DP / EP ranks, on its own links;
  at EP 1 the experts are ordinary parameters (ZeRO-3 gathers every expert of every layer);
- EP: each MoE layer dispatches and combines its tokens by all-to-all, once each in forward
  and backward: 4 * (tokens per rank) * top_k * hidden * act_bytes * (EP - 1) / EP bytes per
  MoE layer (of the fullest stage) and rank per step (6 with recompute: the forward runs twice),
  uniform routing assumed, on the node's links when every EP group sits inside a node, else the
  inter-node ones. Under TP every TP rank dispatches the same (replicated) tokens in its own group.
Communication is not overlapped with compute (DeepSpeed's overlap_comm hides part of it): an
upper bound, the same for every layout.

Imports `zeroshard.estimate` (and `zeroshard.errors`); never a process group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from zeroshard.errors import ZeroshardError
from zeroshard.estimate.activations import ActivationOptions, bubble_fraction
from zeroshard.estimate.parallel import Layout, StageEstimate, estimate_activations, estimate_layout, stage_banks
from zeroshard.estimate.spec import ModelSpec
from zeroshard.estimate.states import Precision, Setup, ZeroStage, estimate_rank

GiB = 2**30


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The machines: nodes of identical devices, two link classes.

    Bandwidths are bytes per second per device in one direction (GB = 2^30 bytes, as the CLI):
    `intra_bandwidth` over the node's fabric (NVLink), `inter_bandwidth` the device's share of the node's network (a DGX
    has one 200 Gbit/s NIC per GPU: 25 GB/s; an A100 has 300 GB/s of NVLink each way).
    """

    nodes: int
    devices_per_node: int
    device_memory: int
    intra_bandwidth: float = 300 * GiB
    inter_bandwidth: float = 25 * GiB
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
    zero_stages: tuple[ZeroStage, ...] = (0, 1, 2, 3)
    schedules: tuple[str, ...] = ("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble")
    tp_sizes: tuple[int, ...] | None = None
    """Only these TP sizes (None: every divisor of the node's devices that divides the heads)."""
    pp_sizes: tuple[int, ...] | None = None
    ep_sizes: tuple[int, ...] | None = None
    """Only layouts with these EP sizes (None: every divisor of DP that divides the experts)."""


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Seconds per optimizer step, by term (see the module docstring)."""

    compute: float
    bubble: float
    tp: float
    pp: float
    dp: float
    ep: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp + self.pp + self.dp + self.ep


@dataclass(frozen=True, kw_only=True)
class Candidate:
    layout: Layout
    zero_stage: ZeroStage
    micro_batch: int
    checkpointing: bool
    memory: int
    """Device bytes of the fullest rank."""
    worst: StageEstimate
    time: StepTime
    fits: bool

    def label(self) -> str:
        ckpt = ", recompute" if self.checkpointing else ""
        return (f"{self.layout.label()}, ZeRO-{self.zero_stage}, micro batch {self.micro_batch} x "
                f"{self.layout.micro_batches}{ckpt}")


@dataclass(frozen=True, kw_only=True)
class Plan3D:
    candidates: list[Candidate]
    """Every layout evaluated, fastest first."""
    cluster: Cluster
    training: Training
    spec: ModelSpec

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
    """Whether some pair of neighbouring stages sits on different nodes (a stage is dp * tp
    consecutive ranks): then that boundary's link paces the pipeline."""
    return layout.pp > 1 and layout.world_size > devices_per_node


def _spans_nodes(layout: Layout, groups: list[list[int]], devices_per_node: int) -> bool:
    """Whether some group of data-parallel positions, in some (stage, TP rank), holds ranks of two
    nodes: position d of stage s and TP rank t is rank (s * dp + d) * tp + t (comm/topology.py)."""
    tp, dp = layout.tp, layout.dp
    return any(len({((s * dp + d) * tp + t) // devices_per_node for d in group}) > 1
               for s in range(layout.pp) for t in range(tp) for group in groups)


def ep_spans_nodes(layout: Layout, devices_per_node: int) -> bool:
    """Whether some EP group (EP consecutive data-parallel ranks of one (stage, TP rank)) crosses a node."""
    return layout.ep > 1 and _spans_nodes(layout, layout.dims.expert_rank_lists()[0], devices_per_node)


def expert_dp_spans_nodes(layout: Layout, devices_per_node: int) -> bool:
    """Whether some expert-data-parallel group (DP / EP data-parallel ranks, one every EP) crosses a node."""
    return layout.dims.expert_dp > 1 and _spans_nodes(layout, layout.dims.expert_rank_lists()[1], devices_per_node)


def active_params(spec: ModelSpec) -> int:
    """Parameters a token goes through: every one for a dense model, top_k experts per MoE layer."""
    return spec.total_params if spec.experts is None else spec.experts.active_params


def flops_per_step(spec: ModelSpec, train: Training, checkpointing: bool) -> float:
    tokens = train.global_batch * train.seq_len
    attention = 0.0
    if spec.shape is not None:
        attention = 12 * spec.shape.num_layers * spec.shape.hidden_size * train.seq_len * tokens
    total = 6 * active_params(spec) * tokens + attention
    return total * (4 / 3 if checkpointing else 1.0)


def zero_bytes(n: int, group: int, setup: Setup, per_batch_grads: int) -> float:
    """Bytes a rank moves per step for `n` parameters under ZeRO over `group` ranks (the module
    docstring's DP / ZeRO term; `per_batch_grads`: gradient reductions per step)."""
    if group <= 1:
        return 0.0
    frac = (group - 1) / group
    g, p = setup.grad_bytes, setup.param_bytes
    return {0: 2 * frac * n * g,
            1: frac * n * (g + p),
            2: frac * n * (g * per_batch_grads + p),
            3: frac * n * (g * per_batch_grads + 2 * p * per_batch_grads)}[setup.zero_stage]


def all_to_all_bytes(spec: ModelSpec, train: Training, layout: Layout, checkpointing: bool,
                     moe_layers: int | None = None) -> float:
    """Bytes one rank sends per step by the MoE layers' token all-to-alls (the EP term): 4 passes
    (dispatch and combine, forward and backward; 6 with recompute) x MoE layers (`moe_layers`: its
    stage's; default every one) x tokens per rank x top_k x hidden x activation bytes x (EP - 1) / EP."""
    split, shape = spec.experts, spec.shape
    if layout.ep <= 1 or split is None or shape is None:
        return 0.0
    tokens = train.global_batch * train.seq_len / layout.dp
    act_bytes = 4 if train.precision == "fp32" else 2
    passes = 6 if checkpointing else 4
    layers = split.moe_layers if moe_layers is None else moe_layers
    return passes * layers * tokens * split.top_k * shape.hidden_size * act_bytes * (layout.ep - 1) / layout.ep


def grad_reductions(layout: Layout) -> int:
    """Gradient reductions per step: one per micro-batch, once per batch under a pipeline (which
    hands the batch's gradient over once)."""
    return 1 if layout.pp > 1 else layout.micro_batches


def expert_zero_bytes(spec: ModelSpec, layout: Layout, setup: Setup, expert_params: int | None = None) -> float:
    """ZeRO bytes a rank moves per step for its experts (`expert_params`: its share, default expert
    params / EP) over DP / EP ranks."""
    if spec.experts is None:
        return 0.0
    mine = spec.experts.expert_params // layout.ep if expert_params is None else expert_params
    return zero_bytes(mine, layout.dims.expert_dp, setup, grad_reductions(layout))


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
    g = cluster.devices_per_node
    bw = cluster.inter_bandwidth if dp_spans_nodes(layout, g) else cluster.intra_bandwidth
    per_batch_grads = grad_reductions(layout)
    ep = 0.0
    if layout.ep > 1 and spec.experts is not None:
        edp_bw = cluster.inter_bandwidth if expert_dp_spans_nodes(layout, g) else cluster.intra_bandwidth
        dp = (zero_bytes(worst.spec.total_params, layout.dp, setup, per_batch_grads) / bw
              + expert_zero_bytes(spec, layout, setup, worst.expert_params) / edp_bw)
        ep_bw = cluster.inter_bandwidth if ep_spans_nodes(layout, g) else cluster.intra_bandwidth
        ep = all_to_all_bytes(spec, train, layout, checkpointing, worst.moe_layers) / ep_bw
    else:
        dp = zero_bytes(worst.spec.total_params, layout.dp, setup, per_batch_grads) / bw
    return StepTime(compute=compute, bubble=bubble, tp=tp, pp=pp, dp=dp, ep=ep)


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
    base = Setup(zero_stage=0, precision=train.precision, optimizer_state_bytes=train.optimizer_state_bytes,
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
            for zero_stage, ep in ((z, e) for z in train.zero_stages for e in _ep_sizes(spec, train, dp)):
                setup = replace(base, zero_stage=zero_stage)
                states = estimate_layout(spec, setup, Layout.of(tp=tp, pp=pp, dp=dp, ep=ep), every_rank=False)
                for micro in (b for b in _divisors(per_rank) if b <= train.max_micro_batch and b & (b - 1) == 0):
                    m = per_rank // micro
                    for sched, v in _schedules(train, pp, states[0].layers):
                        for sp in ((False, True) if tp > 1 else (False,)):
                            layout = Layout.of(tp=tp, pp=pp, dp=dp, ep=ep, micro_batches=m, schedule=sched,
                                               virtual=v, sequence_parallel=sp)
                            for ckpt in ckpts:
                                out.append(_candidate(spec, train, cluster, layout, setup, states, micro, ckpt, act))
    if not out:
        raise ZeroshardError(f"global batch {train.global_batch} divides over no layout of {world} devices: "
                             "give a multiple of the data-parallel sizes (e.g. of the device count)")
    # Times within 0.1% are a tie: the larger memory margin wins, then the lower ZeRO stage.
    out.sort(key=lambda c: (not c.fits, float(f"{c.time.total:.3g}"), c.memory, c.zero_stage))
    return Plan3D(candidates=out, cluster=cluster, training=train, spec=spec)


def _ep_sizes(spec: ModelSpec, train: Training, dp: int) -> list[int]:
    """EP sizes searched for a layout of `dp` data-parallel ranks (whatever its TP and PP): 1, and for
    a MoE model every divisor of dp that divides the expert count; `train.ep_sizes` filters them."""
    sizes = [1]
    if spec.experts is not None:
        sizes += [e for e in _divisors(dp)[1:] if spec.experts.num_experts % e == 0]
    return [e for e in sizes if train.ep_sizes is None or e in train.ep_sizes]


def _candidate(spec: ModelSpec, train: Training, cluster: Cluster, layout: Layout, setup: Setup,
               states: list[StageEstimate], micro: int, ckpt: bool, act: ActivationOptions) -> Candidate:
    opt = replace(act, micro_batch=micro, checkpointing=ckpt, tp=layout.tp, sequence_parallel=layout.sequence_parallel)
    peaks = [s.device_peak + estimate_activations(spec, layout, s.stage, s.layers, opt) for s in states]
    i = max(range(len(states)), key=peaks.__getitem__)
    worst = replace(states[i], activations=peaks[i] - states[i].device_peak)
    time = step_time(spec, train, cluster, layout, setup, worst, micro, ckpt)
    return Candidate(layout=layout, zero_stage=setup.zero_stage, micro_batch=micro, checkpointing=ckpt,
                     memory=peaks[i], worst=worst, time=time, fits=peaks[i] <= cluster.device_budget)


def _gb(n: float) -> str:
    return f"{n / GiB:.1f} GB"


_TERMS = (("compute", "compute"), ("bubble", "pipeline bubble"), ("tp", "TP all-reduces"), ("pp", "PP p2p"),
          ("dp", "DP/ZeRO collectives"), ("ep", "EP all-to-alls"))


def _why_slower(c: Candidate, best: Candidate) -> str:
    """The term that costs `c` most against `best`."""
    if float(f"{c.time.total:.3g}") == float(f"{best.time.total:.3g}"):
        return (f"{c.time.total:.2f} s, a tie in the model (within 0.1%): the choice needs less memory "
                f"({_gb(c.memory)} there)")
    name, label = max(_TERMS, key=lambda t: getattr(c.time, t[0]) - getattr(best.time, t[0]))
    return (f"{c.time.total:.2f} s (+{c.time.total / best.time.total - 1:.1%}): {label} "
            f"{getattr(c.time, name):.2f} s vs {getattr(best.time, name):.2f} s")


def _alternative(plan: Plan3D, label: str, keep: Callable[[Candidate], bool]) -> str | None:
    """One "why" line: the best candidate of a class that excludes the choice."""
    best = plan.chosen
    assert best is not None
    group = [c for c in plan.candidates if keep(c)]
    if not group:
        return None
    fit = [c for c in group if c.fits]
    if fit:
        return f"- {label}: best is {fit[0].label()}, {_why_slower(fit[0], best)}"
    small = min(group, key=lambda c: c.memory)
    return (f"- {label}: nothing fits; the most frugal, {small.label()}, needs {_gb(small.memory)} per device "
            f"> {_gb(plan.cluster.device_budget)} usable")


def placement_lines(layout: Layout, devices_per_node: int) -> list[str]:
    """Where the groups of a layout sit (comm/topology.py's rank order, node-major launch numbering)."""
    g = devices_per_node
    stage_ranks = layout.tp * layout.dp
    lines = [f"- TP groups: {layout.tp} consecutive ranks, inside one node of {g}"
             + ("" if layout.tp > 1 else " (no TP)")]
    if layout.dp > 1:
        where = (f"one rank every {layout.tp}, across {-(-layout.dp * layout.tp // g)} nodes (inter-node links)"
                 if dp_spans_nodes(layout, g) else "inside one node")
        lines.append(f"- DP groups: {layout.dp} ranks, {where}; {layout.pp * layout.tp} such groups communicate "
                     "at once, each over its own ranks")
    if layout.ep > 1:
        where = "across nodes (inter-node links)" if ep_spans_nodes(layout, g) else "inside one node"
        apart = f" ({layout.tp} ranks apart: one TP rank's)" if layout.tp > 1 else ""
        stage = " of its stage's" if layout.pp > 1 else " of every"
        lines.append(f"- EP groups: {layout.ep} consecutive data-parallel ranks{apart}, {where}, each holding "
                     f"1/{layout.ep}{stage} expert bank" + (", whole on every TP rank" if layout.tp > 1 else ""))
        edp = layout.dims.expert_dp
        if edp > 1:
            where = "across nodes (inter-node links)" if expert_dp_spans_nodes(layout, g) else "inside one node"
            lines.append(f"- expert-DP groups: {edp} ranks one every {layout.ep} data-parallel ranks, {where}: ZeRO "
                         "over them for the experts they share")
    if layout.pp > 1:
        if not pp_spans_nodes(layout, g):
            where = "all in one node (p2p inside the node)"
        elif stage_ranks >= g:
            where = f"each stage {stage_ranks // g} node(s), neighbours on different nodes (p2p on inter-node links)"
        else:
            where = f"{g // stage_ranks} stages per node, every {g // stage_ranks}th boundary on an inter-node link"
        lines.append(f"- PP: {layout.pp} stages of {stage_ranks} ranks: {where}")
    return lines


def _ep_line(plan: Plan3D, best: Candidate) -> str | None:
    """Why the chosen EP size against EP 1, in expert states per rank and bytes moved per step."""
    split, lay = plan.spec.experts, best.layout
    if split is None or lay.ep == 1:
        return None
    setup = Setup(zero_stage=best.zero_stage, precision=plan.training.precision,
                  optimizer_state_bytes=plan.training.optimizer_state_bytes, devices_per_node=lay.dp)
    one_layout = Layout.of(dp=lay.dp, micro_batches=lay.micro_batches)
    banks = stage_banks(plan.spec, lay.pp, best.worst.stage)  # the fullest stage's
    if not banks:
        return None
    whole = sum(sum(split.banks[i]) for i in banks)
    states_one = estimate_rank(split.share(1, banks), setup, 0).device.total
    states_ep = estimate_rank(split.share(lay.ep, banks), replace(setup, devices_per_node=lay.dims.expert_dp),
                              0).device.total
    gathers = "ZeRO-3 gathers" if best.zero_stage == 3 else f"ZeRO-{best.zero_stage} traffic"
    moved_one = expert_zero_bytes(plan.spec, one_layout, setup, whole)
    moved_ep = expert_zero_bytes(plan.spec, lay, setup, whole // lay.ep)
    a2a = all_to_all_bytes(plan.spec, plan.training, lay, best.checkpointing, len(banks))
    ratio = states_one / max(states_ep, 1)
    smaller = (f"{ratio:.1f}x smaller" if ratio >= 1.05 else
               f"the same: ZeRO-{best.zero_stage} shards them over all {lay.dp} ranks either way")
    return (f"- EP {lay.ep} against EP 1 (same ZeRO-{best.zero_stage}): expert states {_gb(states_ep)} vs "
            f"{_gb(states_one)} per rank ({smaller}); {gathers} of experts "
            f"({_gb(moved_one)} per step) replaced by token all-to-alls ({_gb(a2a)}) and expert ZeRO over "
            f"{lay.dims.expert_dp} rank(s) ({_gb(moved_ep)}): {_gb(a2a + moved_ep)} vs {_gb(moved_one)} per rank "
            f"per step ({len(banks)} MoE layers{' on the fullest stage' if lay.pp > 1 else ''}, top-{split.top_k} of "
            f"{split.num_experts} experts)")


def report_3d(plan: Plan3D, top: int = 5) -> str:
    """The search's table, why the choice beats the best of each other class, and its placement."""
    cl, tr, spec = plan.cluster, plan.training, plan.spec
    moe = spec.experts
    params = f"{spec.total_params / 1e9:.2f}B params"
    if moe is not None:
        params += (f", {moe.active_params / 1e9:.2f}B active: {moe.moe_layers} MoE layers of {moe.num_experts} "
                   f"experts, top-{moe.top_k}")
    lines = [
        f"3D plan for {spec.name} ({params}) on {cl.nodes} node(s) x "
        f"{cl.devices_per_node} device(s) of {_gb(cl.device_memory)} ({_gb(cl.device_budget)} usable); {tr.precision}, "
        f"sequence {tr.seq_len}, global batch {tr.global_batch} ({tr.global_batch * tr.seq_len / 1e6:.2f}M tokens)",
        f"links per device: {cl.intra_bandwidth / GiB:g} GB/s inside a node, {cl.inter_bandwidth / GiB:g} GB/s across "
        f"nodes; {cl.device_flops / 1e12:g} TFLOP/s achieved per device; communication not overlapped (upper bound)",
        f"searched {len(plan.candidates)} layouts (TP inside a node x PP x DP, ZeRO 0-3, micro batch, schedule, "
        f"sequence parallel, recompute{', EP over DP for the experts' if moe else ''}): {len(plan.fitting)} fit",
    ]
    best = plan.chosen
    if best is None:
        small = min(plan.candidates, key=lambda c: c.memory)
        lines.append(f"no layout fits: the most frugal, {small.label()}, needs {_gb(small.memory)} per device; "
                     "add devices, shorten the sequence or offload (the plan without --3d walks the offloads)")
        return "\n".join(lines)
    ep_head, ep_col = ("  EP    ", lambda c: f" {c.time.ep:6.2f}") if moe else ("", lambda c: "")
    lines += ["", f"  step s | compute  bubble  TP      PP      DP    {ep_head} | memory/rank | layout",
              *(f"  {c.time.total:6.2f} | {c.time.compute:6.2f} {c.time.bubble:6.2f} {c.time.tp:6.2f} {c.time.pp:6.2f} "
                f"{c.time.dp:6.2f}{ep_col(c)} | {_gb(c.memory):>11} | {c.label()}" for c in plan.fitting[:top]),
              "", "why:"]
    lay = best.layout
    checks = [
        (f"TP other than {lay.tp}", lambda c: c.layout.tp != lay.tp),
        ("no pipeline (PP 1)" if lay.pp > 1 else "a pipeline (PP > 1)", lambda c: (c.layout.pp > 1) != (lay.pp > 1)),
        (f"PP other than {lay.pp}", lambda c: c.layout.pp not in (1, lay.pp) if lay.pp > 1 else False),
        (f"ZeRO stage other than {best.zero_stage}", lambda c: c.zero_stage != best.zero_stage),
        ("no recompute" if best.checkpointing else "activation checkpointing",
         lambda c: c.checkpointing != best.checkpointing),
    ]
    if lay.tp > 1:
        checks.append(("without sequence parallelism" if lay.sequence_parallel else "with sequence parallelism",
                       lambda c: c.layout.tp > 1 and c.layout.sequence_parallel != lay.sequence_parallel))
    if lay.pp > 1:
        checks.append((f"schedule other than {lay.schedule}",
                       lambda c: c.layout.pp > 1 and c.layout.schedule != lay.schedule))
    if moe is not None:
        if lay.ep > 1:
            checks += [("EP 1 (every expert on every rank)", lambda c: c.layout.ep == 1),
                       (f"EP other than {lay.ep}", lambda c: c.layout.ep not in (1, lay.ep))]
        else:
            checks.append(("expert parallelism (EP > 1)", lambda c: c.layout.ep > 1))
    for label, keep in checks:
        line = _alternative(plan, label, keep)
        if line:
            lines.append(line)
    ep_line = _ep_line(plan, best)
    if ep_line:
        lines.append(ep_line)
    t = best.time
    worst = best.worst
    lines += ["", "placement (rank = (pp * dp + d) * tp + t; nodes hold consecutive ranks):",
              *placement_lines(lay, cl.devices_per_node), "",
              f"choice: {best.label()}: {t.total:.2f} s per step (compute {t.compute:.2f} + bubble {t.bubble:.2f} + "
              f"TP {t.tp:.2f} + PP {t.pp:.2f} + DP {t.dp:.2f}{f' + EP {t.ep:.2f}' if moe else ''}); "
              f"fullest rank (stage {worst.stage}) "
              f"{_gb(best.memory)} = states {_gb(worst.rank.device.total)} + ZeRO buffers "
              f"{_gb(worst.rank.device_buffers)} + pipeline batch buffers {_gb(worst.pipeline_buffers)} + activations "
              f"{_gb(worst.activations)}, margin {_gb(cl.device_budget - best.memory)}"]
    return "\n".join(lines)
