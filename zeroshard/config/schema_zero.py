"""The `zero_optimization` section: stage, buckets, offload, stage-3 and ZeRO++ keys.

Field names are DeepSpeed's JSON keys; sizes are counts of elements, not bytes. Which stage each
key applies to is data in `config/zero_stages.py`. Imports nothing of zeroshard but `config.fields`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from zeroshard.config.fields import spec

OffloadDevice = Literal["none", "cpu", "nvme"]


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadOptimizerConfig:
    """`zero_optimization.offload_optimizer`: where the fp32 master shard and optimizer states live."""

    device: OffloadDevice = "none"
    """Home of the fp32 master weights and optimizer states between steps: "none" (the
    accelerator), "cpu" (host memory; the step runs on the CPU) or "nvme" (files under
    `nvme_path`, stage 3 only). Default "none": offload trades speed for memory."""
    nvme_path: Path | None = None
    """Directory for the swap files. Required when `device` is "nvme"."""
    buffer_count: int = spec(4, ge=0)
    """Number of I/O buffers for NVMe swapping (DeepSpeed's default, 4). In zeroshard: slots of
    the NVMe step's pool, each one sub-group's master, exp_avg and exp_avg_sq (at least 3 used);
    the last sub-groups stepped stay in them across steps and are not swapped."""
    pin_memory: bool = True
    """Keep the CPU copies in page-locked memory: faster host<->device copies, at the cost of
    memory the OS cannot page out. Default true, as in DeepSpeed 0.19. Acted on at stages 1-3
    when a CUDA device exists (zero/offload/policy.py)."""
    pipeline_read: bool = False
    """Overlap reading the next sub-group from NVMe with the current step (NVMe only)."""
    pipeline_write: bool = False
    """Overlap writing the previous sub-group to NVMe with the current step (NVMe only)."""
    fast_init: bool = False
    """Initialise the optimizer states faster when offloading to NVMe."""
    ratio: float = spec(1.0, ge=0.0, le=1.0)
    """Fraction of the optimizer step run on the CPU; below 1.0 is partial offload, stage 3
    only: as DeepSpeed does with its sub-groups, the first int((1 - ratio) * n) of the n units
    keep their master weights, gradient shard and optimizer state on the device, the rest are
    offloaded (docs/offload.md). Default 1.0: everything offloaded once offload is on."""
    super_offload: bool = False
    """DeepSpeed's SuperOffload mode (superchip CPU-GPU optimizer overlap)."""
    cpuadam_cores_perc: float = spec(0.8, ge=0.0, le=1.0)
    """Fraction of CPU cores the CPU optimizer may use (SuperOffload)."""
    delayed_update: bool = False
    """zeroshard's extension: the ZeRO-Offload paper's one-step delayed parameter update. After
    `delayed_update_warmup_steps` synchronous steps, the CPU optimizer step of step k runs in a
    background thread during step k+1's forward and backward, so the forward of step k+1 uses
    the weights of step k-1's update (one step of staleness). `device` "cpu" only. Default false:
    every step's update is applied before the next forward (docs/offload.md)."""
    delayed_update_warmup_steps: int = spec(40, ge=0)
    """zeroshard's extension: optimizer steps run synchronously before the delayed update starts
    (the paper delays only after a few dozen warm-up iterations, when gradients change fastest).
    Default 40."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ZenFlowConfig:
    """`zero_optimization.zenflow`: DeepSpeed's ZenFlow (stages 1-3 with CPU optimizer offload).

    Each step, the top-k columns of every 2-D weight (by the L1 norm of their gradient) and every
    1-D parameter are updated on the model's device by their own AdamW; the whole gradient is
    accumulated and stepped by the CPU optimizer every `update_interval` steps, whose update
    lands on the other columns (docs/offload.md, Note: [zenflow rule] in zero/offload/zenflow.py).
    The section's presence turns it on (`{}` too), as in DeepSpeed; `enabled` is set by the loader.
    Built for fp32 and bf16 training (fp32 masters), with or without `gradient_clipping` (each of
    the two updates clipped by its own gradient's norm: Note: [zenflow clip]); the rest is refused
    by name.
    """

    enabled: bool = spec(False, json_key=False)
    """True when the config has a `zenflow` section (set by the loader, not a JSON key)."""
    topk_ratio: float = spec(0.1, gt=0.0, lt=1.0)
    """Share of each 2-D weight's columns updated every step on the device: max(1, int(columns *
    topk_ratio)) columns. DeepSpeed's default 0.1."""
    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    """What `select_interval` counts: "step" (optimizer steps) or "epoch" (epochs of initialize()'s
    training data loader, or `steps_per_epoch`); "auto" is "epoch" with select_interval 1, as in
    DeepSpeed. Without an epoch length the columns are selected once. Default "auto", as in DeepSpeed."""
    select_interval: int = "auto"  # type: ignore[assignment]  # DeepSpeed's "auto" (auto.py::OFF_RULES keeps it)
    """Steps (or epochs) between two selections of the top-k columns (0: select once, at the first
    step after the warm-up); "auto" with select_strategy "auto" only. At least `update_interval`
    once counted in steps. Default "auto"."""
    update_interval: int = "auto"  # type: ignore[assignment]  # DeepSpeed's "auto" (auto.py::OFF_RULES keeps it)
    """Steps between two CPU optimizer steps on the accumulated gradient; "auto": DeepSpeed's
    adaptive interval, a CPU step after each step whose gradient outside the selected columns has
    grown past their own on `auto_ratio` of the 2-D weights (Note: [zenflow auto update] in
    zero/offload/zenflow_state.py). Default "auto"."""
    overlap_step: bool = False
    """Run the CPU step on a background thread while the next steps train; its result reaches the
    model at the next CPU step, one CPU step late, with DeepSpeed's numbers (Note: [zenflow overlap]
    in zero/offload/zenflow_overlap.py; DeepSpeed uses a separate process). Default false."""
    offload: bool = False
    """DeepSpeed: keep the selected columns' AdamW states in CPU memory between steps (same numbers,
    less device memory). Not built: true is refused by name. Default false."""
    auto_ratio: float = spec(0.99, ge=0.0, le=1.0)
    """Share of the 2-D weights that must call for a CPU step before update_interval "auto" takes
    one; without effect with an integer update_interval. DeepSpeed's default 0.99."""
    full_warm_up_rounds: int = spec(0, ge=0)
    """Steps, from the first, in which the CPU optimizer steps every step on the whole gradient
    with no selection; selection starts after them. Default 0."""
    pt_reserved_cores_perc: float = spec(0.5, ge=0.0, le=1.0)
    """DeepSpeed: share of the CPU cores left to PyTorch by the overlapped optimizer process
    (`overlap_step`); without effect here (the overlapped step is a thread sharing the training
    process's cores). Default 0.5."""
    steps_per_epoch: int | None = spec(None, ge=1)
    """Optimizer steps per epoch for the "epoch" and "auto" select strategies. Set from
    initialize()'s training data loader when there is one (as DeepSpeed does, which says it
    "should not be set by users"); zeroshard reads a value from the file when there is no loader.
    Default null."""

    @property
    def select_steps(self) -> int:
        """Optimizer steps between two selections: select_interval ("step"), select_interval
        epochs ("epoch"), one epoch ("auto"); 0 (select once) while the epoch length is unknown."""
        if self.select_strategy == "step":
            return int(self.select_interval)
        epochs = 1 if self.select_strategy == "auto" else int(self.select_interval)
        return epochs * self.steps_per_epoch if self.steps_per_epoch is not None else 0


DEFAULT_LEAF_MODULE_CLASSES: tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
"""DeepSpeed 0.19.8's default leaf classes (its mixture-of-experts blocks)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LeafModuleConfig:
    """`zero_optimization.leaf_module`: modules stage 3 gathers as one unit (zero/leaf.py), as
    `set_z3_leaf_modules` / `_by_name` / `_by_suffix` mark them; what matches nothing is skipped."""

    classes: tuple[str, ...] = spec(DEFAULT_LEAF_MODULE_CLASSES, str_as_list=True)
    """Class names or qualified names (`module.Class`) of leaf modules. Default: DeepSpeed's MoE
    blocks (Mixtral, Qwen2-MoE, Qwen3-MoE)."""
    names: tuple[str, ...] = spec((), str_as_list=True)
    """`named_modules()` names of leaf modules."""
    name_suffixes: tuple[str, ...] = spec((), str_as_list=True)
    """Suffixes of `named_modules()` names: every module whose name ends with one is a leaf."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadParamConfig:
    """`zero_optimization.offload_param`: where stage 3 keeps parameter shards (stage 3 only)."""

    device: OffloadDevice = "none"
    """Home of the parameter shards between uses: "none", "cpu" or "nvme" (a memory-mapped swap
    file per rank under `nvme_path`, read ahead in execution order). Stage 3 only."""
    nvme_path: Path | None = None
    """Directory for the parameter swap files. Required when `device` is "nvme"."""
    buffer_count: int = spec(5, ge=0)
    """Number of buffers in DeepSpeed's NVMe parameter swap pool (DeepSpeed's default, 5). Without
    effect in zeroshard: the shard is a memory-mapped swap file paged in unit by unit, bounded by
    `max_in_cpu` (zero/offload/nvme_params.py)."""
    buffer_size: int = spec(100_000_000, ge=0)
    """Size of each of DeepSpeed's NVMe swap buffers, in elements (default 1e8). Without effect in
    zeroshard, as `buffer_count`."""
    max_in_cpu: int = spec(1_000_000_000, ge=0)
    """Parameter elements kept in CPU memory when the shards are on NVMe: past it, the least
    recently used units are written back and dropped. Default 1e9."""
    pin_memory: bool = True
    """Keep the CPU parameter copies in page-locked memory (faster copies, unpageable).
    Default true, as in DeepSpeed 0.19. Acted on when a CUDA device exists (zero/offload/policy.py)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """`zero_optimization`: what is partitioned across data-parallel ranks, and how.

    Stage 0 is plain data parallelism; 1 partitions optimizer states, 2 also gradients, 3 also
    parameters. Bucket sizes are element counts (a bucket of 5e8 bf16 elements is 1 GB).
    """

    stage: Literal[0, 1, 2, 3] = 0
    """ZeRO stage: 0 (data parallel), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters).
    Default 0, as in DeepSpeed: partitioning is opt-in."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation).
    Accepted at every stage; stage 0 always reduces from contiguous buckets."""
    reduce_scatter: bool = True
    """Stage 2: reduce each gradient bucket with reduce-scatter (each rank receives only its
    chunk) instead of all-reduce. Stage 1 always all-reduces its whole-gradient buckets at the
    step boundary and keeps its chunk."""
    reduce_bucket_size: int = spec(500_000_000, ge=0)
    """Elements per gradient reduction bucket; larger buckets mean fewer, bigger collectives
    and more memory. Read by stages 0, 1 and 2 (stage 0 all-reduces in buckets); stage 3
    reduce-scatters each unit's gradients as one collective and does not read it yet. "auto"
    with a known hidden size h: h*h. DeepSpeed's default, 5e8."""
    use_multi_rank_bucket_allreduce: bool = True
    """DeepSpeed: reduce a bucket spanning several ranks' partitions with one all-reduce
    (stages 1 and 2). Accepted without effect: zeroshard reduces each bucket with one collective
    whatever partitions it spans."""
    allgather_partitions: bool = True
    """Gather updated parameters with all-gather (true) or a series of broadcasts (false)
    after each step (stages 1 and 2)."""
    allgather_bucket_size: int = spec(500_000_000, ge=0)
    """Elements per all-gather bucket for the updated parameters (stages 1 and 2). Default 5e8."""
    overlap_comm: bool = False
    """Overlap gradient reduction with the rest of backward. DeepSpeed's default depends on
    the stage: true at stage 3, false otherwise. Stage 0 always overlaps; the key is accepted.
    Stages 1 and 2: true keeps up to two bucket reductions in flight while backward goes on;
    false waits for each bucket's reduction before backward continues."""
    load_from_fp32_weights: bool = True
    """On checkpoint load, rebuild the low-precision weights from the fp32 master copy, as
    zeroshard always does; false (keep the saved 16-bit weights) is not supported yet."""
    elastic_checkpoint: bool = False
    """DeepSpeed: save optimizer partitions so they can be loaded at another world size
    (stages 1, 2). Accepted without effect: every zeroshard checkpoint loads at any world size
    and stage (resharded on load)."""
    offload_param: OffloadParamConfig = spec(default_factory=OffloadParamConfig)
    """Parameter offload (stage 3 only)."""
    leaf_module: LeafModuleConfig = spec(default_factory=LeafModuleConfig)
    """Leaf modules: gathered whole at stage 3 (stage 3 only)."""
    offload_optimizer: OffloadOptimizerConfig = spec(default_factory=OffloadOptimizerConfig)
    """Optimizer-state offload (stages 1-3; NVMe and partial ratios at stage 3 only)."""
    zenflow: ZenFlowConfig = spec(default_factory=ZenFlowConfig)
    """DeepSpeed's ZenFlow: top-k gradient columns stepped on the device every step, the rest
    accumulated and stepped on the CPU every `update_interval` steps (stages 1-3, CPU offload)."""
    sub_group_size: int = spec(1_000_000_000, ge=0)
    """Elements updated per optimizer sub-step at stage 3 (the NVMe swap granularity).
    Lower it on out-of-memory during the step. Default 1e9."""
    stage3_prefetch_bucket_size: int = spec(50_000_000, ge=0)
    """Elements of parameters prefetched ahead of use at stage 3. "auto" with hidden size h:
    int(0.9*h*h). DeepSpeed's default, 5e7."""
    stage3_param_persistence_threshold: int = spec(100_000, ge=0)
    """Parameters with fewer elements stay gathered at stage 3 (not worth re-gathering).
    "auto" with hidden size h: 10*h. DeepSpeed's default, 1e5."""
    stage3_model_persistence_threshold: int = spec(sys.maxsize, ge=0)
    """Upper bound on the total elements of persistent parameters at stage 3: walking the
    model's parameters in order, one that would take the total past it stays partitioned (as in
    DeepSpeed's engine). Default: no limit."""
    stage3_max_live_parameters: int = spec(1_000_000_000, ge=0)
    """Upper bound on gathered (full) parameter elements alive at once at stage 3. Default 1e9."""
    stage3_max_reuse_distance: int = spec(1_000_000_000, ge=0)
    """Keep a gathered parameter if it is used again within this many elements of
    parameters fetched (stage 3), counting through the rest of forward into backward, as
    DeepSpeed does. Default 1e9: a model below 1e9 elements stays gathered from each unit's
    forward to its backward (backward gathers nothing again); set it lower to release units
    after their forward and gather them again for backward (less memory, one more all-gather
    per unit)."""
    stage3_release_grads: bool = False
    """zeroshard's extension: give each stage-3 unit's gradient shard its own storage, allocated at
    the unit's first reduction of a step and released after the optimizer step (FSDP2's
    gradient lifetime), instead of one shard kept for the whole run (DeepSpeed's); the pool of
    gradient staging blocks is freed after the step too. Saves the gradient shard (4 bytes per
    parameter / dp size in fp32) and the pool during forward, where activations peak; the
    numbers are unchanged. Gradients can then be read (`safe_get_full_grad`) only
    between backward and step. No effect on an offloaded optimizer (its shard is host memory)."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Gather the full 16-bit weights on model save at stage 3 (costly for big models).
    Legacy spelling: stage3_gather_fp16_weights_on_model_save."""
    stage3_module_granularity_threshold: int = spec(0, ge=0)
    """Stage 3: gather fine-grained modules in one piece. A module's granularity is its
    parameter elements divided by the modules with parameters in its subtree (DeepSpeed's
    measure); each outermost module at or below the threshold that contains stage-3 units (a
    ModuleList's blocks) replaces them with one unit: fewer, larger all-gathers. A module
    inside a unit is already gathered with it and changes nothing. 0 = off; when no module
    qualifies, the log names the smallest granularity."""
    stage3_use_all_reduce_for_fetch_params: bool = False
    """Gather stage-3 parameters with all-reduce instead of all-gather (DeepSpeed option)."""
    stage3_allgather_sequential: bool = False
    """Issue stage-3 parameter all-gathers one at a time (DeepSpeed option)."""
    ignore_unused_parameters: bool = True
    """Tolerate parameters that receive no gradient in a step (they get a zero gradient). false:
    stages 1 and 2 raise (UsageError, an AssertionError as DeepSpeed's) at the step's last
    backward, naming the parameters that got no gradient in the whole step."""
    legacy_stage1: bool = False
    """DeepSpeed's pre-0.3 stage-1 implementation. Not provided by zeroshard."""
    round_robin_gradients: bool = False
    """Stage 1/2 gradient-copy parallelism across ranks for CPU offload. Accepted with no
    effect: in zeroshard each rank copies only its own gradient shard to CPU, so there is no
    cross-rank copy order to balance."""
    zero_hpz_partition_size: int = spec(1, ge=0)
    """ZeRO++ hpZ (stage 3): ranks per secondary parameter partition, which must be the ranks
    per node (LOCAL_WORLD_SIZE) and divide the world size (checked at initialize). Each rank
    keeps a second copy of the parameters partitioned within its node, rebuilt after each step
    (the only parameter gathers that cross nodes); the gathers of forward and backward read it
    inside the node. Costs padded/node_size extra elements per rank. 1 (or 0) = off."""
    zero_quantized_weights: bool = False
    """ZeRO++ qwZ (stage 3): the parameter all-gathers of forward and backward carry int8 codes
    with one fp32 scale per 2048 elements of each rank's chunk (about 1/2 of the bf16/fp16
    bytes, 1/4 of fp32), dequantised on arrival; each gathered weight is off by at most its
    block's max |w| / 254. Master weights, optimizer state, the persistent parameters and user
    gathers (GatheredParameters, saving) stay exact."""
    zero_quantized_nontrainable_weights: bool = False
    """ZeRO++: keep frozen weights quantized (stage 3)."""
    zero_quantized_gradients: bool = False
    """ZeRO++ qgZ (stage 3): reduce each unit's gradients as int4 codes with one fp32 scale per
    2048 elements, exchanged by all-to-all and summed in fp32 (about 1/8 of the fp32 bytes).
    Each rank's contribution is off by at most its block's max |g| / 14 per element. When the job
    spans several nodes of several ranks, two levels: int8 within the node, then int4 partial
    sums across nodes (s times fewer inter-node bytes for s ranks per node; bound in
    zero/reduce.py, Note: [hierarchical qgZ])."""
    mics_shard_size: int = spec(-1, ge=-1)
    """MiCS: shard parameters within groups of this many ranks (stage 3); -1 = off."""
    mics_hierarchical_params_gather: bool = False
    """MiCS hierarchical all-gather (stage 3)."""
    memory_efficient_linear: bool = True
    """Stage 3: use a linear-layer autograd function that does not keep gathered weights."""
    pipeline_loading_checkpoint: bool = False
    """Load checkpoints one local rank at a time (each rank reads its part while the node's
    other ranks wait), bounding a node's host memory during the load. Every stage (DeepSpeed:
    stage 3 only)."""
    override_module_apply: bool = True
    """Stage 3: gather parameters inside `nn.Module.apply` calls."""
    log_trace_cache_warnings: bool = False
    """Stage 3: log when the recorded execution trace is invalidated."""
    enable_sanity_checks: bool = False
    """Stage 3: run extra (slow) consistency checks."""
    save_muon_momentum_buffer_in_memory: bool = False
    """Stage 3 with Muon and NVMe offload: keep the momentum buffer in memory."""
