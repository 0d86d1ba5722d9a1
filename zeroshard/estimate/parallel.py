"""Memory per rank under tensor x pipeline x data parallelism (3D), for every ZeRO stage.

A rank at pipeline stage `s` and tensor-parallel rank `t` holds the parameters of its stage's
layers, split over `tp` where Megatron's layout splits them, and ZeRO partitions that share over
the `dp` ranks of its (stage, TP rank) coordinate, exactly as estimate/states.py does for a whole
model. So `stage_spec` builds the per-rank `ModelSpec` and `estimate_stage` hands it to
`estimate_rank` with the data-parallel size as the world:

- stages: the transformer blocks (the spec's ZeRO-3 units after the root) split uniformly
  over `pp` stages (Megatron's layout; the first stages take one more when it does not divide);
  the token embedding on pipeline stage 0, the output head and the final norm on the last stage (a tied
  head keeps a copy there, as DeepSpeed's `TiedLayerSpec` does), other root parameters (position
  embeddings) on stage 0.
- tensor parallelism: every block parameter larger than the hidden size is split over `tp` (the
  column / row weights, column biases) and so is an untied output head (vocabulary-parallel); the
  rest is replicated on every TP rank (norms, row-parallel biases, the input embedding, which
  zeroshard's AutoTP leaves whole as the Hugging Face plans do), so a TP rank holds more than 1 / tp.
- the pipeline engine (runtime/pipe_engine.py) keeps each micro-batch's gradient aside until the
  batch ends (Note: [pipeline gradient capture]): a whole local gradient per stage in the
  accumulation dtype, on top of the strategy's buffers, at every ZeRO stage; at ZeRO stages 2 and 3
  the reducer's staging pool then grows towards a whole gradient too (the batch's gradient
  arrives in one burst), and at ZeRO stage 3 the pipeline stage's parameters stay gathered for the batch.
- activations: `stage_activation_bytes` with the schedule's micro-batches in flight and the
  TP (and sequence-parallel) split.
- experts (a spec with `experts`): AutoTP never splits an expert bank nor a router (tensor_parallel/
  tp_plan.py::shard_model skips expert parameters; no Hugging Face plan names a router), so every
  TP rank holds them whole; a bank sits on the pipeline stage of the block holding it. With
  `ep` > 1 the rank's model states are estimate/expert_states.py's `estimate_rank_ep`: its dense
  share (TP- and stage-split as above) under ZeRO over `dp`, and 1 / ep of each of its stage's
  banks under ZeRO over the `dp / ep` expert-data-parallel ranks. The expert groups are made inside
  each (stage, TP rank)'s data-parallel ranks (moe/prepare.py, Notes: [experts under tensor
  parallelism] and [experts in pipeline stages]), so EP divides `dp`, never `tp` or `pp`
  (DeepSpeed's AutoEP folding over the TP ranks is not what zeroshard builds: docs/moe.md). The
  engine is tested at TP 2 x EP 2 and PP 2 x EP 2; EP x TP x PP together follows from the same
  rules but the engine path is not tested there.

Imports `comm.parallel_dims` (pure integers), `estimate.spec`, `estimate.states`, `estimate.activations`,
`estimate.expert_states`; never a process group.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from zeroshard.comm.parallel_dims import ParallelDims, PipeShape, resolve_dims
from zeroshard.errors import ZeroshardError
from zeroshard.estimate.activations import ActivationOptions, Schedule, in_flight, stage_activation_bytes
from zeroshard.estimate.expert_states import estimate_rank_ep
from zeroshard.estimate.spec import ModelSpec
from zeroshard.estimate.states import RankEstimate, Setup, estimate_rank


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A 3D layout and how its pipeline runs.

    Attributes:
        dims: the sizes of every dimension (comm/parallel_dims.py's `ParallelDims`, the one
            description `initialize` trains with); `Layout.of` resolves them from tp / pp / dp.
        micro_batches: micro-batches per optimizer step and pipeline (gradient accumulation steps).
        schedule: the pipeline schedule (`pipeline.schedule`).
        virtual: stages per rank for the interleaved schedules.
        sequence_parallel: TP's sequence parallelism (tp_model_init(..., sequence_parallel=True)).
    """

    dims: ParallelDims
    micro_batches: int = 1
    schedule: Schedule = "1f1b"
    virtual: int = 1
    sequence_parallel: bool = False

    @classmethod
    def of(cls, *, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1, **how: Any) -> Layout:
        """The layout of `tp` x `pp` x `dp` ranks, its dims resolved as `initialize` resolves an AutoTP
        config on a PipelineModule of `pp` stages, `ep` of the `dp` ranks splitting the experts
        (`how`: the other fields).

        >>> layout = Layout.of(tp=2, pp=2, dp=2)
        >>> (layout.tp, layout.pp, layout.dp, layout.world_size), layout.dims.tp_split
        ((2, 2, 2, 8), 'autotp')
        """
        for name, size in (("tp", tp), ("pp", pp), ("dp", dp), ("ep", ep)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ZeroshardError(f"Layout.{name} must be an integer >= 1, got {size!r}")
        return cls.for_world(tp * pp * dp, tp=tp, pp=pp, ep=ep, **how)

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, ep: int = 1, **how: Any) -> Layout:
        """The layout `resolve_dims` gives `world_size` ranks with `tp`, `pp` and `ep` (the data-parallel
        size is the rest of the world: resolve_dims's error when tp x pp does not divide it, or ep dp)."""
        return cls(dims=resolve_dims(world_size, config_tp=tp, pipe=PipeShape(pp=pp), ep=ep), **how)

    def __post_init__(self) -> None:
        for name in ("micro_batches", "virtual"):
            if getattr(self, name) < 1:
                raise ZeroshardError(f"Layout.{name} must be >= 1, got {getattr(self, name)}")
        if self.virtual > 1 and not self.schedule.startswith("interleaved"):
            raise ZeroshardError(f"virtual stages ({self.virtual}) need an interleaved schedule, not {self.schedule}")
        if self.dims.sp > 1:
            raise ZeroshardError(f"the 3D estimator does not model sequence parallelism yet ({self.dims.describe()})")

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def ep(self) -> int:
        return self.dims.ep

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    def label(self) -> str:
        text = f"TP {self.tp} x PP {self.pp} x DP {self.dp}"
        if self.ep > 1:
            text += f" (EP {self.ep} x expert-DP {self.dims.expert_dp})"
        if self.pp > 1:
            text += f", {self.schedule}" + (f" v={self.virtual}" if self.virtual > 1 else "")
        return text + (" + SP" if self.sequence_parallel and self.tp > 1 else "")


@dataclass(frozen=True, kw_only=True)
class StageEstimate:
    """What one rank of pipeline stage `stage` holds.

    Attributes:
        spec: the rank's share of the model (its stage's parameters, TP-split); with EP > 1 its dense
            share only.
        rank: the model states and ZeRO buffers of the rank with the most (over its dp group).
        pipeline_buffers: the gradient kept aside during a batch (and ZeRO stage 3's parameters
            gathered for it); 0 without a pipeline.
        activations: activation bytes at the schedule's peak.
        layers: transformer layers on the stage.
        expert_params: with EP > 1, the elements of the rank's experts (1 / ep of its stage's banks).
        moe_layers: the expert banks on the stage (each dispatches its tokens by all-to-all).
    """

    stage: int
    spec: ModelSpec
    rank: RankEstimate
    pipeline_buffers: int
    activations: int
    layers: float
    expert_params: int = 0
    moe_layers: int = 0

    @property
    def device_peak(self) -> int:
        return self.rank.device_peak + self.pipeline_buffers + self.activations


def _split_units(n_units: int, pp: int) -> list[range]:
    if n_units < pp:
        raise ZeroshardError(f"{pp} pipeline stages but the model has {n_units} blocks: use at most {n_units} stages")
    base, extra = divmod(n_units, pp)
    bounds, start = [], 0
    for s in range(pp):
        end = start + base + (1 if s < extra else 0)
        bounds.append(range(start, end))
        start = end
    return bounds


def _tp_numel(numel: int, hidden: int, tp: int, whole: frozenset[int] = frozenset()) -> int:
    return numel if tp == 1 or numel <= hidden or numel in whole else -(-numel // tp)


def stage_spec(spec: ModelSpec, pp: int, tp: int, stage: int, whole: frozenset[int] = frozenset()) -> ModelSpec:
    """The parameters one TP rank of pipeline stage `stage` holds, as a ModelSpec (see the module
    docstring for the placement rules). A spec from counts without a shape is split evenly. Block
    parameters whose size is in `whole` stay whole on every TP rank (experts and routers: the
    `ExpertSplit.tp_whole` of a MoE model)."""
    if not 0 <= stage < pp:
        raise ZeroshardError(f"stage {stage} outside a pipeline of {pp} stages")
    if pp == 1 and tp == 1:
        return spec
    if spec.unit_params is None or len(spec.unit_params) < 2:
        if spec.shape is None:
            share = -(-spec.total_params // (pp * tp))
            return replace(spec, name=f"{spec.name} [stage {stage}]", total_params=share,
                           largest_layer_params=-(-spec.largest_layer_params // tp), param_numels=None,
                           unit_params=None)
        return _stage_spec_from_shape(spec, pp, tp, stage)
    hidden = spec.shape.hidden_size if spec.shape else 0
    vocab_numel = spec.shape.vocab_size * hidden if spec.shape else -1
    root, blocks = spec.unit_params[0], spec.unit_params[1:]
    embeddings = [n for n in root if n == vocab_numel]
    norms = [n for n in root if n <= hidden]
    others = [n for n in root if n != vocab_numel and n > hidden]
    first, last = stage == 0, stage == pp - 1
    # The input embedding stays whole on every TP rank (zeroshard's AutoTP follows the Hugging Face
    # plans, which leave embed_tokens replicated), as do position embeddings and norms; an untied
    # output head is split over the vocabulary; a tied one is the embedding's copy, whole.
    own_root: list[int] = []
    if first:
        own_root += embeddings[:1] + others
    if last:
        own_root += norms + [_tp_numel(n, hidden, tp) for n in embeddings[1:2]]
        own_root += embeddings[:1] if len(embeddings) == 1 and pp > 1 else []
    units = [tuple(_tp_numel(n, hidden, tp, whole) for n in blocks[i]) for i in _split_units(len(blocks), pp)[stage]]
    numels = tuple(own_root) + tuple(n for u in units for n in u)
    largest = max([max(u, default=0) for u in units] + [max(own_root, default=0)])
    return ModelSpec(name=f"{spec.name} [stage {stage}/{pp}, tp {tp}]", total_params=sum(numels),
                     largest_layer_params=largest, param_numels=numels,
                     unit_params=(tuple(own_root), *units), shape=spec.shape, live=spec.live)


def _stage_spec_from_shape(spec: ModelSpec, pp: int, tp: int, stage: int) -> ModelSpec:
    """Counts plus a shape: the embedding (and an untied head when the count leaves room for
    one) from the vocabulary, the rest shared evenly by the layers."""
    shape = spec.shape
    assert shape is not None
    embed = shape.vocab_size * shape.hidden_size
    layers_total = spec.total_params - embed
    per_layer = layers_total / shape.num_layers
    mine = _split_units(shape.num_layers, pp)[stage]
    own = len(mine) * per_layer / tp + (embed / tp if stage == 0 or stage == pp - 1 else 0)
    total = int(own)
    return replace(spec, name=f"{spec.name} [stage {stage}/{pp}, tp {tp}]", total_params=max(1, total),
                   largest_layer_params=min(total, -(-spec.largest_layer_params // tp)), param_numels=None,
                   unit_params=None)


def _layers_on(spec: ModelSpec, pp: int, stage: int) -> float:
    """Transformer layers of `stage` (T5's sub-layer units are counted back into layers)."""
    if spec.shape is None:
        return 0.0
    if spec.unit_params is None or len(spec.unit_params) < 2:
        return float(len(_split_units(spec.shape.num_layers, pp)[stage]))
    n_units = len(spec.unit_params) - 1
    return len(_split_units(n_units, pp)[stage]) * spec.shape.num_layers / n_units


def estimate_stage(spec: ModelSpec, setup: Setup, layout: Layout, stage: int,
                   activations: ActivationOptions | None = None, *, every_rank: bool = True) -> StageEstimate:
    """One rank of pipeline stage `stage`: its model states under ZeRO over `layout.dp`, the
    pipeline's batch buffers and, when `activations` is given (and the spec has a shape), the
    activations of its schedule's micro-batches in flight.

    `setup` gives the ZeRO stage, precision, buckets and optimizer; its world size is replaced by
    `layout.dp`. The rank reported is the data-parallel rank holding the most (padding differs;
    `every_rank=False`: rank 0, which a search over thousands of layouts uses).
    """
    split = spec.experts
    dp_setup = replace(setup, devices_per_node=layout.dp, nodes=1)
    expert_params, banks = 0, stage_banks(spec, layout.pp, stage)
    if layout.ep > 1:
        if split is None:
            raise ZeroshardError(f"EP {layout.ep}: {spec.name} has no expert bank")
        share = stage_spec(split.dense, layout.pp, layout.tp, stage, split.tp_whole)
        ranks = range(layout.dp) if every_rank and layout.dp <= 8 and share.param_numels is not None else [0]
        rank = max((estimate_rank_ep(split, dp_setup, layout.ep, r, dense=share, banks=banks) for r in ranks),
                   key=lambda e: e.device_peak)
        expert_params = sum(sum(split.banks[i]) for i in banks) // layout.ep
    else:
        share = stage_spec(spec, layout.pp, layout.tp, stage, split.tp_whole if split is not None else frozenset())
        ranks = range(layout.dp) if every_rank and layout.dp <= 8 and share.param_numels is not None else [0]
        rank = max((estimate_rank(share, dp_setup, r) for r in ranks), key=lambda e: e.device_peak)
    local = share.total_params + expert_params
    pipe = 0
    if layout.pp > 1:
        pipe = setup.grad_bytes * local
        if setup.zero_stage >= 2:
            # The batch's gradient reaches the reducer in one burst, so its staging pool holds
            # up to every bucket at once, not the plain engine's window (measured at PP 2 x DP 2:
            # 6 of 8 blocks, tests/dist/test_memory_census_3d.py): bounded by a whole gradient.
            pipe += max(0, setup.grad_bytes * local - rank.staging_pool)
        if setup.zero_stage == 3 and setup.offload_param == "none":
            pipe += setup.param_bytes * local
    layers = _layers_on(spec, layout.pp, stage)
    act = 0 if activations is None else estimate_activations(spec, layout, stage, layers, activations)
    return StageEstimate(stage=stage, spec=share, rank=rank, pipeline_buffers=pipe, activations=act, layers=layers,
                         expert_params=expert_params, moe_layers=len(banks))


def stage_banks(spec: ModelSpec, pp: int, stage: int) -> tuple[int, ...]:
    """The indices of the expert banks pipeline stage `stage` holds: those of its blocks (a bank in
    the root goes with stage 0); every bank without a pipeline, none for a model without experts."""
    split = spec.experts
    if split is None:
        return ()
    if pp == 1:
        return tuple(range(len(split.banks)))
    units = split.dense.unit_params
    n_blocks = len(units) - 1 if units is not None and len(units) >= 2 else (spec.shape.num_layers if spec.shape else 0)
    mine = _split_units(n_blocks, pp)[stage]
    return tuple(i for i, b in enumerate(split.blocks_of_banks(n_blocks)) if b in mine or (b < 0 and stage == 0))


def estimate_activations(spec: ModelSpec, layout: Layout, stage: int, layers: float,
                         activations: ActivationOptions) -> int:
    """Activation bytes of one rank of `stage` holding `layers` layers, at its schedule's peak."""
    if spec.shape is None:
        return 0
    opt = activations
    if (opt.tp, opt.sequence_parallel) != (layout.tp, layout.sequence_parallel):
        opt = replace(activations, tp=layout.tp, sequence_parallel=layout.sequence_parallel)
    flight = in_flight(layout.schedule, layout.pp, stage, layout.micro_batches, layout.virtual)
    head_flight = float(layout.micro_batches) if layout.schedule == "gpipe" and layout.pp > 1 else 1.0
    return stage_activation_bytes(spec.shape, opt, layers, first=stage == 0, last=stage == layout.pp - 1,
                                  in_flight=flight, head_in_flight=head_flight)


def estimate_layout(spec: ModelSpec, setup: Setup, layout: Layout, activations: ActivationOptions | None = None,
                    *, every_rank: bool = True) -> list[StageEstimate]:
    """Every pipeline stage's fullest rank (see `estimate_stage`)."""
    return [estimate_stage(spec, setup, layout, s, activations, every_rank=every_rank) for s in range(layout.pp)]


def worst_stage(stages: list[StageEstimate]) -> StageEstimate:
    """The stage whose rank needs the most device memory: the one that decides whether a layout fits."""
    return max(stages, key=lambda e: e.device_peak)
