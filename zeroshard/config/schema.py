"""The typed, frozen `Config` tree a ds_config.json is parsed into, once, by `load_config`.

Field names are DeepSpeed's JSON keys; every field documents its meaning, unit and default
(docs/config.md is generated from these docstrings). Imports nothing of zeroshard outside config/.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from zeroshard.config.describe import describe_config
from zeroshard.config.fields import MAX_SAMPLES, FrozenDict, spec
from zeroshard.config.schema_compile import CompileConfig
from zeroshard.config.schema_ep import ExpertParallelConfig
from zeroshard.config.schema_fp8 import Fp8Config
from zeroshard.config.schema_optim import OptimizerConfig, SchedulerConfig
from zeroshard.config.schema_tp import TensorParallelConfig
from zeroshard.config.schema_zero import ZeroConfig

DType = Literal["fp32", "fp16", "bf16"]
Precision = Literal["fp32", "fp16", "bf16"]


@dataclass(frozen=True, kw_only=True, slots=True)
class FP16Config:
    """`fp16`: mixed precision with float16 and loss scaling."""

    enabled: bool = False
    """Train with fp16 weights/activations and fp32 master weights. "auto" resolves to false
    unless initialize() says otherwise."""
    auto_cast: bool = False
    """Cast the model inputs to fp16 in forward."""
    loss_scale: float = spec(0.0, ge=0.0)
    """Static loss scale; 0 (the default) selects dynamic loss scaling."""
    initial_scale_power: int = spec(16, ge=0, le=127)
    """Dynamic scaling starts at 2**initial_scale_power. Default 16 (65536)."""
    loss_scale_window: int = 1000
    """Steps without overflow before the dynamic scale doubles: >= 1 when the scale is dynamic
    (fp16 on, loss_scale 0); any integer otherwise, where it is unused (as in DeepSpeed)."""
    hysteresis: int = spec(2, ge=1)
    """Overflows tolerated before the dynamic scale is halved."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every step without overflow."""
    min_loss_scale: float = 1.0
    """Floor of the dynamic loss scale: > 0 and <= the initial scale when the scale is dynamic
    (fp16 on, loss_scale 0); any number otherwise, where it is unused (as in DeepSpeed)."""
    fp16_master_weights_and_grads: bool = False
    """Keep master weights and gradients in fp16 (DeepSpeed CPU-Adam only)."""

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when the loss scale adapts to overflows (loss_scale == 0)."""
        return self.loss_scale == 0.0

    @property
    def initial_loss_scale(self) -> float:
        """The scale of the first step: loss_scale if static, else 2**initial_scale_power."""
        return self.loss_scale if self.loss_scale else float(2**self.initial_scale_power)


@dataclass(frozen=True, kw_only=True, slots=True)
class BF16Config:
    """`bf16` (legacy spelling `bfloat16`): mixed precision with bfloat16, no loss scaling."""

    enabled: bool = False
    """Train with bf16 weights/activations and fp32 master weights. "auto" resolves to false
    unless initialize() says otherwise."""
    immediate_grad_update: bool = False
    """DeepSpeed: fold each micro-batch's bf16 gradients into the fp32 accumulator as soon as
    backward produces them. Accepted without effect: zeroshard always accumulates into the
    `data_types.grad_accum_dtype` buffers right after each backward."""
    check_grad_overflow: bool = True
    """Skip a step whose gradients hold inf/nan. Default true, as in DeepSpeed 0.19. Accepted
    without effect: zeroshard computes the global gradient norm every step (for clipping) and
    always skips a non-finite step, at every precision."""
    bf16_master_weights_and_grads: bool = False
    """Keep master weights and gradients in bf16 instead of fp32."""
    bf16_optimizer_states: bool = False
    """Keep optimizer states in bf16 (needs bf16_master_weights_and_grads)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DataTypesConfig:
    """`data_types`: dtypes of internal buffers."""

    grad_accum_dtype: DType | None = None
    """dtype gradients are accumulated (and reduced) in across micro-batches. null: fp32 under
    bf16/fp16 mixed precision (zeroshard's numerics-first default), the parameter dtype otherwise."""
    param_dtype: DType | None = None
    """The parameters' training dtype, as a statement: it must agree with fp16 / bf16 `enabled`
    (fp32 when neither is), which decide it; null says nothing (DeepSpeed 0.19's rule)."""
    buffer_dtype: DType | None = None
    """Under bf16 / fp16: the dtype floating-point buffers are cast to. null (the default, as in
    DeepSpeed 0.19) keeps each buffer's own dtype, e.g. a rotary embedding's fp32 `inv_freq`,
    which bf16 would round. Unused under fp32."""
    keep_in_fp32_modules: tuple[str, ...] | None = None
    """Under bf16 / fp16: floating-point buffers kept in fp32 (upcast if they arrive in a lower
    precision, and never cast by `buffer_dtype`), e.g. an MoE router's `e_score_correction_bias`,
    whose values bf16 cannot tell apart. "auto" or null (the default, as in DeepSpeed 0.19.8):
    the names the model's own Transformers lists give (`_keep_in_fp32_modules_strict` of every
    submodule, plus `_keep_in_fp32_modules` under fp16); a list: name patterns, `*` for any
    characters, each matching anywhere in a buffer's full name; []: none. Parameters always
    follow the training dtype."""


AutocastDType = Literal["torch.bfloat16", "bfloat16", "bf16", "torch.float16", "float16", "fp16", "half"]
"""DeepSpeed's spellings of the two autocast dtypes (its DtypeEnum); fp32 and int8 are refused."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TorchAutocastConfig:
    """`torch_autocast`: run the forward under `torch.autocast` while parameters, gradients and
    master weights keep their training dtype (fp32 unless `bf16`/`fp16` is also enabled)."""

    enabled: bool = False
    """Wrap the engine's forward in `torch.autocast(device_type, dtype)`."""
    dtype: AutocastDType | None = None
    """Autocast dtype; null = torch's default for the device (bf16 on CPU, fp16 on CUDA)."""
    lower_precision_safe_modules: tuple[str, ...] | None = None
    """Fully qualified module classes ("torch.nn.Linear") whose parameters' gradients DeepSpeed
    communicates in the autocast dtype; null = Linear and Conv1d/2d/3d. Checked to import at
    initialize; zeroshard reduces every gradient in its accumulation dtype (see
    docs/deepspeed-differences.md)."""

    @property
    def precision(self) -> Literal["bf16", "fp16"] | None:
        """The autocast dtype as a precision name; None = the device's default."""
        if self.dtype is None:
            return None
        return "bf16" if "bf" in self.dtype else "fp16"


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorBoardConfig:
    """`tensorboard`: write training scalars as TensorBoard event files (rank 0)."""

    enabled: bool = False
    """Write event files."""
    output_path: str = ""
    """Directory for the event files; "" = the current directory."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory name for this run. DeepSpeed's default name, kept for familiarity."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CSVMonitorConfig:
    """`csv_monitor`: write training scalars as CSV files (rank 0)."""

    enabled: bool = False
    """Write CSV files."""
    output_path: str = ""
    """Directory for the CSV files; "" = the current directory."""
    job_name: str = "DeepSpeedJobName"
    """Sub-directory name for this run."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WandbConfig:
    """`wandb`: log training scalars to Weights & Biases."""

    enabled: bool = False
    """Log to W&B from rank 0 (needs the wandb package: pip install 'zeroshard[wandb]').
    WANDB_MODE=offline writes the run locally, with no network."""
    group: str | None = None
    """W&B run group."""
    team: str | None = None
    """W&B team (entity)."""
    project: str = "deepspeed"
    """W&B project. DeepSpeed's default name."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CommsLoggerConfig:
    """`comms_logger`: record every collective (op, size, time) and summarise it."""

    enabled: bool = False
    """Record collectives."""
    verbose: bool = False
    """Log each collective as it completes, not only the summary."""
    prof_all: bool = True
    """Record every collective op (true) or only those in prof_ops (false)."""
    debug: bool = False
    """Add the calling function's name to each record."""
    prof_ops: tuple[str, ...] = ()
    """Op names to record when prof_all is false, e.g. ["all_reduce", "all_gather"]."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AioConfig:
    """`aio`: asynchronous NVMe I/O for ZeRO-Infinity swapping."""

    block_size: int = spec(1_048_576, ge=1)
    """Bytes per I/O request."""
    queue_depth: int = spec(8, ge=1)
    """I/O requests in flight per thread."""
    intra_op_parallelism: int = spec(1, ge=1)
    """I/O threads per request."""
    single_submit: bool = False
    """Submit requests one at a time instead of in batches."""
    overlap_events: bool = True
    """Overlap request submission with completion polling."""
    use_gds: bool = False
    """Use NVIDIA GPUDirect Storage."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationCheckpointingConfig:
    """`activation_checkpointing`: how `zeroshard.checkpointing.checkpoint` runs (DeepSpeed's block).

    initialize() applies the block when the file sets any of its keys, as
    `zeroshard.checkpointing.configure(None, deepspeed_config=...)` would. It affects regions the
    model runs through `zeroshard.checkpointing`; HF's gradient_checkpointing_enable() uses
    torch.utils.checkpoint directly and needs no block.
    """

    partition_activations: bool = False
    """Split checkpointed inputs over model-parallel ranks. zeroshard has no model parallelism:
    accepted as a no-op (model-parallel size 1); refused by configure() for a larger mpu."""
    cpu_checkpointing: bool = False
    """Keep checkpointed inputs in CPU memory until their recompute; a no-op when training on CPU."""
    contiguous_memory_optimization: bool = False
    """DeepSpeed copies partitioned checkpoints into one preallocated buffer against
    fragmentation. Accepted, no effect (the caching allocator handles it; see
    docs/deepspeed-differences.md). Needs partition_activations and number_checkpoints, as in DeepSpeed."""
    number_checkpoints: int | None = spec(None, ge=1)
    """Checkpointed layers per forward (sizes DeepSpeed's contiguous buffer)."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronize the device before and after each checkpointed forward and recompute."""
    profile: bool = False
    """Time the recomputes; shown as `recompute` in the wall-clock breakdown and monitors."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelWriteConfig:
    """`checkpoint.parallel_write`: parallel checkpoint writing."""

    pipeline_stage: bool = False
    """Each pipeline stage writes its own part."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """`checkpoint`: DeepSpeed's checkpoint options."""

    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"
    """DeepSpeed: check that every rank saves with the same tag (ignore, warn or fail on a
    mismatch). Accepted without effect: zeroshard always refuses a save_dir or tag that differs
    across ranks, whatever this says."""
    load_universal: bool = False
    """A load without a tag reads `latest_universal` (a DeepSpeed universal checkpoint, which
    `ds_to_universal` or `zeroshard to-deepspeed` writes) even where `latest` exists. Universal
    checkpoints load at any world size and ZeRO stage whatever this says; without it, `latest_universal`
    is read only where there is no `latest`."""
    use_node_local_storage: bool = False
    """Each node's first rank writes its node's copy of the non-sharded files (model file,
    manifest, `latest`) next to its ranks' shards, so a disk of each node's own holds a checkpoint
    that node resumes from (Trainer's `save_on_each_node`); on shared storage, rank 0 writes."""
    parallel_write: ParallelWriteConfig = spec(default_factory=ParallelWriteConfig)
    """Parallel writing options."""
    checkpoint_serialization: bool = True
    """Use torch.save's serialization format."""
    auto_resume_dir: Path | None = None
    """zeroshard's extension: a checkpoint root (the `save_dir` the script saves into). When set,
    `initialize()` loads the newest complete and verified checkpoint there (skipping damaged or
    half-written tags with a warning), with the random generators and the data loader's position,
    and keeps its train_batch_size by recomputing gradient_accumulation_steps for this
    data-parallel size. Nothing there: training starts fresh. null: off (scripts load themselves)."""
    async_save: bool = False
    """zeroshard's extension: `save_checkpoint` copies this rank's state to host memory and returns;
    a background thread writes the files while training continues. The manifest and `latest` follow
    once every rank's files are on disk, at the next join: the next save, `engine.wait_for_checkpoint()`,
    a load or `engine.destroy()` (call one before exiting). Costs one host copy of the rank's state.
    Not with a PipelineModule or tensor parallelism yet. false: every save writes before returning."""
    save_dir: Path | None = None
    """zeroshard's extension: the checkpoint root of the periodic saves (`save_interval_steps`,
    `save_interval_minutes`); tags are `global_step{N}`. null: no periodic saves."""
    save_interval_steps: int = spec(0, ge=0)
    """zeroshard's extension: save to `save_dir` after every this many optimizer steps (at the end of
    `engine.step()`). 0: off. Needs `save_dir`."""
    save_interval_minutes: float = spec(0.0, ge=0.0)
    """zeroshard's extension: save to `save_dir` at the first optimizer step this many minutes after
    the last periodic save (or the start). Ranks agree by rank 0's clock (one 1-element all-reduce
    per step while set). 0: off. Needs `save_dir`."""
    keep_last: int = spec(0, ge=0)
    """zeroshard's extension: after each save, remove all but the newest this many complete
    checkpoints of the directory saved into (ordered by saved step; the tag `latest` names is always
    kept, directories without a manifest are never touched). 0: keep every checkpoint."""
    preemption_save: bool = True
    """zeroshard's extension: on SIGTERM or SIGUSR1 (SLURM's `--signal=USR1@T` warning before a time
    limit), every rank finishes the optimizer step in progress, saves an emergency checkpoint to
    `save_dir` (else `auto_resume_dir`) after the same step, and exits with status 75 ("preempted:
    restart me"; docs/checkpoints.md). Acts when one of those directories is set; costs a 2-element
    all-reduce per optimizer step. false: the signals keep their default action (the process dies,
    and a restart resumes from the last checkpoint saved)."""
    preemption_grace_seconds: float = spec(25.0, gt=0.0)
    """zeroshard's extension: the most seconds from the first preemption signal (on any rank) to the
    exit. A rank whose emergency checkpoint is not written by then exits without it (status 75, and
    says so); `latest` keeps naming the last complete checkpoint. 25 s: inside the 30 s that SLURM
    (KillWait), Kubernetes (terminationGracePeriodSeconds) and torchrun give before they kill."""


PipeSchedule = Literal["1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineConfig:
    """`pipeline`: the pipeline engine (used when initialize() is given a PipelineModule)."""

    stages: Any = "auto"
    """DeepSpeed's default block carries it and nothing reads it (the stage count is the
    PipelineModule's num_stages / topology). Accepted without effect, as in DeepSpeed."""
    partition: Any = "best"
    """DeepSpeed's default block carries it and nothing reads it (the PipelineModule's
    partition_method cuts the layers). Accepted without effect, as in DeepSpeed."""
    seed_layers: bool = False
    """DeepSpeed's default block carries it and nothing reads it (PipelineModule(seed_layers=)
    does). Accepted without effect, as in DeepSpeed."""
    activation_checkpoint_interval: int = spec(0, ge=0)
    """Recompute activations every this many layers; 0 keeps the PipelineModule's own interval."""
    use_reentrant: bool = True
    """Activation checkpointing with the reentrant implementation (true, DeepSpeed's default) or
    torch's non-reentrant one (false)."""
    pipe_partitioned: bool = True
    """DeepSpeed splits the activations sent between stages over the tensor-parallel ranks. zeroshard's
    pipelines have no tensor parallelism, so there is nothing to split: accepted without effect."""
    grad_partitioned: bool = True
    """As pipe_partitioned, for the gradients sent back between stages: accepted without effect."""
    schedule: PipeSchedule = "1f1b"
    """zeroshard's extension: the pipeline schedule (torch.distributed.pipelining). "1f1b" (the
    default; DeepSpeed's numbers), "gpipe", "interleaved_1f1b" and "interleaved_zero_bubble" (several
    stages per rank: PipelineModule(virtual_stages=v)). Every schedule trains the same numbers."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """A validated ds_config: every value typed, "auto" resolved, the batch triad solved.

    Build with `load_config`; nothing outside `zeroshard.config` reads the raw JSON.
    """

    train_batch_size: int = spec(ge=1, le=MAX_SAMPLES)
    """Samples per optimizer step over all ranks:
    train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp_world_size."""
    train_micro_batch_size_per_gpu: int = spec(ge=1, le=MAX_SAMPLES)
    """Samples per forward/backward on one rank. Derived from the other two when absent."""
    gradient_accumulation_steps: int = spec(ge=1, le=MAX_SAMPLES)
    """Micro-batches per optimizer step. 1 when only one of the other two is given."""
    managed_gradient_accumulation: bool = True
    """True (DeepSpeed's default): the engine counts micro-batches and `step()` steps the
    optimizer on every gradient_accumulation_steps-th call. False (DeepSpeed 0.19): the script
    owns the boundary; `backward()` only accumulates, every `step()` reduces what accumulated and
    steps the optimizer, however many backward passes came before (gradient_accumulation_steps then
    only divides the loss in `backward()` and sizes train_batch_size). Not with a PipelineModule,
    `coalesce_grad_reduction()` or `set_gradient_accumulation_boundary()`, nor overlap_comm at
    stages 0-1 (they reduce in `step()`, with no backward to overlap)."""
    dp_world_size: int = spec(ge=1, json_key=False)
    """Data-parallel world size the batch triad was solved for (from comm, not the file)."""
    optimizer: OptimizerConfig | None = None
    """The optimizer to build; null when the script passes its own."""
    scheduler: SchedulerConfig | None = None
    """The lr scheduler to build; null for none (or the script's own)."""
    fp16: FP16Config = spec(default_factory=FP16Config)
    """fp16 mixed precision."""
    bf16: BF16Config = spec(default_factory=BF16Config)
    """bf16 mixed precision (legacy key `bfloat16`)."""
    torch_autocast: TorchAutocastConfig = spec(default_factory=TorchAutocastConfig)
    """Forward under torch.autocast with parameters in their training dtype."""
    zero_optimization: ZeroConfig = spec(default_factory=ZeroConfig)
    """ZeRO partitioning and offload."""
    data_types: DataTypesConfig = spec(default_factory=DataTypesConfig)
    """Internal buffer dtypes."""
    gradient_clipping: float = spec(1.0, ge=0.0)
    """Clip the global gradient norm (over all ranks) to this value; 0 = off. Default 1.0, as in
    DeepSpeed 0.19 (its documented and code default): a config without the key is clipped."""
    steps_per_print: int | None = spec(10, ge=1, inf_is_none=True)
    """Log progress every N optimizer steps; Infinity or null = never. Default 10, the
    documented DeepSpeed default (DeepSpeed 0.19's code default is null)."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step (synchronizing the device) and log the breakdown."""
    dump_state: bool = False
    """Print the engine's state after initialization."""
    communication_data_type: DType | None = None
    """dtype gradients are communicated (all-reduced / reduce-scattered) in; null = the dtype
    they are accumulated in (see data_types.grad_accum_dtype)."""
    seq_parallel_communication_data_type: DType = "fp32"
    """With sequence parallelism (size > 1) the dtype gradients are communicated in, replacing
    `communication_data_type` (as DeepSpeed's engine does); ignored without it. Default "fp32"."""
    prescale_gradients: bool = False
    """Divide gradients by gradient_predivide_factor before the reduction (not only after)."""
    gradient_predivide_factor: float = spec(1.0, gt=0.0)
    """With prescale_gradients: divide by this before reducing and by world/factor after."""
    tensorboard: TensorBoardConfig = spec(default_factory=TensorBoardConfig)
    """TensorBoard monitor."""
    csv_monitor: CSVMonitorConfig = spec(default_factory=CSVMonitorConfig)
    """CSV monitor."""
    wandb: WandbConfig = spec(default_factory=WandbConfig)
    """Weights & Biases monitor."""
    comms_logger: CommsLoggerConfig = spec(default_factory=CommsLoggerConfig)
    """Collective-communication logger."""
    aio: AioConfig = spec(default_factory=AioConfig)
    """Asynchronous NVMe I/O."""
    activation_checkpointing: ActivationCheckpointingConfig = spec(
        default_factory=ActivationCheckpointingConfig)
    """Activation checkpointing."""
    checkpoint: CheckpointConfig = spec(default_factory=CheckpointConfig)
    """Checkpoint options."""
    pipeline: PipelineConfig = spec(default_factory=PipelineConfig)
    """Pipeline parallelism (a PipelineModule given to initialize())."""
    tensor_parallel: TensorParallelConfig = spec(default_factory=TensorParallelConfig)
    """AutoTP tensor parallelism (zeroshard/tensor_parallel/); ZeRO partitions over the data-parallel ranks."""
    expert_parallel: ExpertParallelConfig = spec(default_factory=ExpertParallelConfig)
    """AutoEP: expert parallelism for Hugging Face MoE models (zeroshard/moe/hf_experts.py); each
    expert bank is cut over `autoep_size` ranks, its parameters sharded by ZeRO over the
    expert-data-parallel group."""
    sequence_parallel_size: int = spec(1, ge=1)
    """Ranks that share one sample, each holding a slice of its sequence (DeepSpeed-Ulysses / ALST
    sequence parallelism, zeroshard/sequence/). The batch triad counts world / (sp x pp x tp)
    data-parallel ranks; ZeRO partitions over the dp x sp ranks, and gradients are summed over the
    sequence-parallel ranks (each backpropagates its share of the loss) and averaged over the
    data-parallel ones."""
    data_parallel_size: int | None = spec(None, ge=1)
    """DeepSpeed's data-parallel size beside `sequence_parallel_size`: when given it must equal
    world / (sequence_parallel_size x pp x tp) (a check; the sizes follow from the world)."""
    fp8: Fp8Config = spec(default_factory=Fp8Config)
    """zeroshard's extension: FP8 training of the linear layers (runtime/fp8.py), over bf16 or fp32
    parameters."""
    compile: CompileConfig = spec(default_factory=CompileConfig)
    """DeepSpeed's DeepCompile options, each refused unless at its default; `engine.compile()`
    compiles the model without them (runtime/compile.py)."""
    zero_allow_untested_optimizer: bool = spec(False, int_as_bool=True)
    """DeepSpeed refuses client optimizers it has not tested with ZeRO unless true. zeroshard
    partitions any torch.optim optimizer, so the flag is accepted and has no effect. An integer
    is read as its truth value, as DeepSpeed does (`1` is true)."""
    zero_force_ds_cpu_optimizer: bool = True
    """DeepSpeed: refuse a client optimizer that is not its CPU Adam when offloading. Accepted
    without effect: zeroshard steps any torch optimizer on the CPU shard (a client torch
    Adam/AdamW is switched to torch's fused CPU kernel)."""
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    """How gradients are combined across data-parallel ranks: "mean" (DeepSpeed's default) or
    "sum" (no division by the data-parallel size, and `gradient_predivide_factor` unused, as in
    DeepSpeed). "sum" is refused with ZeRO stage 3, ZenFlow and DeepCompile (as in DeepSpeed),
    with a PipelineModule and with the 1-bit optimizers."""
    sparse_gradients: bool = False
    """Reduce embedding gradients as sparse tensors."""
    disable_allgather: bool = False
    """DeepSpeed: broadcast instead of all-gather (legacy)."""
    memory_breakdown: bool = False
    """Log memory usage at points of each step."""
    dataloader_drop_last: bool = False
    """Drop the last incomplete batch in the data loader built by initialize()."""
    notes: tuple[str, ...] = spec((), json_key=False)
    """One-line start-up notes from loading (a deprecated spelling mapped, tuning keys of
    another ZeRO stage ignored); initialize() logs them once on rank 0."""
    sources: Mapping[str, str] = spec(
        default_factory=FrozenDict, json_key=False)
    """Provenance: dotted key -> where its value came from ("file", "auto (...)", "derived
    (batch triad)"). Keys absent here hold their defaults."""

    @property
    def precision(self) -> Precision:
        """"fp16", "bf16" or "fp32": the training precision (fp16 and bf16 are exclusive)."""
        if self.fp16.enabled:
            return "fp16"
        if self.bf16.enabled:
            return "bf16"
        return "fp32"

    @property
    def bf16_masters(self) -> bool:
        """bf16.bf16_master_weights_and_grads with bf16.bf16_optimizer_states: the master shard and
        the gradients are bf16 (config/load.py's check refuses bf16 masters beside fp32 states)."""
        return self.bf16.bf16_master_weights_and_grads and self.bf16.bf16_optimizer_states

    @property
    def accumulation_dtype(self) -> DType | None:
        """The dtype micro-batch gradients are summed in, decided once for the strategies and the
        pipeline's gradient capture: bf16 with bf16 masters, else `data_types.grad_accum_dtype`,
        else fp32 under bf16/fp16 training; None in fp32 training with no grad_accum_dtype (the
        parameters' own dtype)."""
        if self.bf16_masters:
            return "bf16"
        named = self.data_types.grad_accum_dtype
        if named is not None:
            return named
        return "fp32" if self.precision != "fp32" else None

    def source_of(self, key: str) -> str:
        """Where the value of dotted `key` came from; "default" when the file did not set it."""
        return self.sources.get(key, "default")

    def describe(self, *, non_default_only: bool = False) -> str:
        """The resolved config as an indented `key = value` listing; each value that is not
        the default is marked with its source. Rank 0 logs this at start-up.

        Example::

            zero_optimization:
              reduce_bucket_size = 589824  # auto (model hidden_size=768)
        """
        return describe_config(self, non_default_only=non_default_only)
