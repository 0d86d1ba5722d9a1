"""The `optimizer` and `scheduler` sections: typed parameters for DeepSpeed's own types.

Parameter names and defaults are those of DeepSpeed's constructors, so the runtime builds a
scheduler with `cls(optimizer, **dataclasses.asdict(params))`. Other `torch.optim` optimizers and
`torch.optim.lr_scheduler` schedulers keep their (signature-checked) params as a read-only
mapping. Imports nothing of zeroshard but `config.fields`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from zeroshard.config.fields import spec

Betas = tuple[float, float]
WarmupType = Literal["log", "linear"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamParams:
    """`optimizer.params` for type Adam / AdamW (DeepSpeed's FusedAdam / CPU Adam arguments)."""

    lr: float = spec(1e-3, ge=0.0)
    """Learning rate. DeepSpeed's default, 1e-3."""
    betas: Betas = spec((0.9, 0.999), ge=0.0, lt=1.0)
    """Coefficients of the running averages of the gradient and its square, each in [0, 1)."""
    eps: float = spec(1e-8, ge=0.0)
    """Term added to the denominator for numerical stability."""
    weight_decay: float = spec(0.0, ge=0.0)
    """Weight decay. Default 0 for both Adam and AdamW, as in DeepSpeed (torch's AdamW
    defaults to 0.01: a ported script keeps DeepSpeed's value)."""
    bias_correction: bool = True
    """Apply Adam's bias correction to the moment estimates."""
    adam_w_mode: bool = True
    """Decoupled weight decay (AdamW). DeepSpeed quirk kept for compatibility: type "Adam"
    also means AdamW unless this is false; type "AdamW" is always decoupled."""
    torch_adam: bool = False
    """DeepSpeed: use torch's Adam instead of its fused kernel. zeroshard always uses torch's
    (fused where available), so both values behave the same."""
    amsgrad: bool = False
    """Use the AMSGrad variant."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LambParams:
    """`optimizer.params` for type Lamb (DeepSpeed's FusedLamb arguments)."""

    lr: float = spec(1e-3, ge=0.0)
    """Learning rate."""
    bias_correction: bool = True
    """Apply bias correction to the moment estimates."""
    betas: Betas = spec((0.9, 0.999), ge=0.0, lt=1.0)
    """Running-average coefficients, each in [0, 1)."""
    eps: float = spec(1e-8, ge=0.0)
    """Term added to the denominator for numerical stability."""
    eps_inside_sqrt: bool = False
    """Add eps inside the square root instead of after it."""
    weight_decay: float = spec(0.0, ge=0.0)
    """Weight decay."""
    max_grad_norm: float = spec(0.0, ge=0.0)
    """Per-optimizer gradient-norm clipping; 0 = off (use top-level gradient_clipping)."""
    max_coeff: float = spec(10.0, gt=0.0)
    """Upper bound of the layer-wise trust ratio. DeepSpeed's default, 10.0."""
    min_coeff: float = spec(0.01, ge=0.0)
    """Lower bound of the layer-wise trust ratio. DeepSpeed's default, 0.01."""
    amsgrad: bool = False
    """AMSGrad variant (DeepSpeed's Lamb rejects it)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OneBitAdamParams:
    """`optimizer.params` for type OneBitAdam (DeepSpeed's OnebitAdam arguments; optim/onebit_adam.py).
    Needs zero_optimization.stage 0, as in DeepSpeed."""

    lr: float = spec(1e-3, ge=0.0)
    """Learning rate."""
    freeze_step: int = spec(100000, ge=1)
    """Full-precision warm-up steps (plain Adam); the momentum is averaged in 1 bit after them
    and the variance stays frozen. DeepSpeed's default, 100000."""
    bias_correction: bool = True
    """Bias correction of the moment estimates (only true: the warm-up is torch's AdamW)."""
    betas: Betas = spec((0.9, 0.999), ge=0.0, lt=1.0)
    """Running-average coefficients, each in [0, 1)."""
    eps: float = spec(1e-8, ge=0.0)
    """Term added to the denominator for numerical stability."""
    eps_inside_sqrt: bool = False
    """Add eps inside the square root (only false: torch's AdamW adds it outside)."""
    weight_decay: float = spec(0.0, ge=0.0)
    """Decoupled weight decay (as AdamW)."""
    max_grad_norm: float = spec(0.0, ge=0.0)
    """Stored and never used by DeepSpeed's OnebitAdam; use top-level gradient_clipping."""
    amsgrad: bool = False
    """AMSGrad variant (only false: 1-bit Adam does not support it, as in DeepSpeed)."""
    cuda_aware: bool = False
    """DeepSpeed's CUDA-aware MPI switch (only false: there is no MPI path)."""
    comm_backend_name: Literal["nccl", "gloo"] = "nccl"
    """Where the compressed all-reduce runs. Both values mean the job's own process group (NCCL on
    CUDA, gloo on CPU), so DeepSpeed's default "nccl" works on a CPU job; DeepSpeed's "mpi" and
    "hccl" are not provided."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroOneAdamParams:
    """`optimizer.params` for type ZeroOneAdam (DeepSpeed's 0/1 Adam arguments; optim/zero_one_adam.py).
    Needs zero_optimization.stage 0, as in DeepSpeed."""

    lr: float = spec(1e-3, ge=0.0)
    """Learning rate."""
    var_freeze_step: int = spec(100000, ge=1)
    """The last step that may update the variance; local steps follow. DeepSpeed's default, 100000."""
    var_update_scaler: int = spec(16, ge=1)
    """Variance updates per interval before the interval doubles (kappa). DeepSpeed's default, 16."""
    local_step_scaler: int = spec(32678, ge=1)
    """Local-phase steps per local interval before the interval doubles. DeepSpeed's default, 32678."""
    local_step_clipper: int = spec(16, ge=1)
    """The largest local interval H (steps between agreements). DeepSpeed's default, 16."""
    bias_correction: bool = True
    """Only true (false is refused, as for Adam). DeepSpeed's ZeroOneAdam stores it and never uses
    it: its update, like zeroshard's, has no bias correction."""
    betas: Betas = spec((0.9, 0.999), ge=0.0, lt=1.0)
    """Running-average coefficients, each in [0, 1)."""
    eps: float = spec(1e-8, ge=0.0)
    """Term added to the denominator for numerical stability."""
    eps_inside_sqrt: bool = False
    """Stored and never used by DeepSpeed's ZeroOneAdam (eps is added outside the square root)."""
    weight_decay: float = spec(0.0, ge=0.0)
    """Decoupled weight decay."""
    max_grad_norm: float = spec(0.0, ge=0.0)
    """Stored and never used by DeepSpeed's ZeroOneAdam; use top-level gradient_clipping."""
    amsgrad: bool = False
    """AMSGrad variant (only false: 0/1 Adam does not support it, as in DeepSpeed)."""
    cuda_aware: bool = False
    """DeepSpeed's CUDA-aware MPI switch (only false: there is no MPI path)."""
    comm_backend_name: Literal["nccl", "gloo"] = "nccl"
    """Where the compressed all-reduce runs: the job's own process group either way (as OneBitAdam)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OneBitLambParams:
    """`optimizer.params` for type OneBitLamb (DeepSpeed's OnebitLamb arguments; optim/onebit_lamb.py).
    Needs zero_optimization.stage 0, as in DeepSpeed."""

    lr: float = spec(1e-3, ge=0.0)
    """Learning rate."""
    freeze_step: int = spec(100000, ge=1)
    """Full-precision warm-up steps (LAMB); then the momentum is averaged in 1 bit and the variance
    and trust ratios are frozen. DeepSpeed's default, 100000."""
    bias_correction: bool = True
    """Only true (false is refused). DeepSpeed's OnebitLamb stores it and never uses it: neither
    its update nor zeroshard's has bias correction."""
    betas: Betas = spec((0.9, 0.999), ge=0.0, lt=1.0)
    """Running-average coefficients, each in [0, 1)."""
    eps: float = spec(1e-8, ge=0.0)
    """Term added to the denominator for numerical stability."""
    eps_inside_sqrt: bool = False
    """Stored and never used by DeepSpeed's OnebitLamb (eps is added outside the square root)."""
    weight_decay: float = spec(0.0, ge=0.0)
    """Weight decay, added to the update inside the trust ratio (as Lamb)."""
    max_grad_norm: float = spec(0.0, ge=0.0)
    """Stored and never used by DeepSpeed's OnebitLamb; use top-level gradient_clipping."""
    max_coeff: float = spec(10.0, gt=0.0)
    """Upper bound of the warm-up trust ratio. DeepSpeed's default, 10.0."""
    min_coeff: float = spec(0.01, ge=0.0)
    """Lower bound of the warm-up trust ratio. DeepSpeed's default, 0.01."""
    amsgrad: bool = False
    """AMSGrad variant (only false, as in DeepSpeed)."""
    cuda_aware: bool = False
    """DeepSpeed's CUDA-aware MPI switch (only false: there is no MPI path)."""
    comm_backend_name: Literal["nccl", "gloo"] = "nccl"
    """Where the compressed all-reduce runs: the job's own process group either way (as OneBitAdam)."""
    coeff_beta: float = spec(0.9, ge=0.0, lt=1.0)
    """Decay of the running average of the warm-up trust ratios, frozen at the end of the warm-up
    (1 / (1 - coeff_beta) should not exceed freeze_step). DeepSpeed's default, 0.9."""
    factor_max: float = spec(4.0, gt=0.0)
    """Upper bound of the compression-stage factor on the frozen trust ratio. DeepSpeed's default, 4.0."""
    factor_min: float = spec(0.5, gt=0.0)
    """Lower bound of that factor. DeepSpeed's default, 0.5."""
    factor_threshold: float = spec(0.1, ge=0.0, lt=1.0)
    """The most the factor may change from one step to the next, relative. DeepSpeed's default, 0.1."""


OptimizerParams = (AdamParams | LambParams | OneBitAdamParams | ZeroOneAdamParams | OneBitLambParams
                   | Mapping[str, Any])


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """`optimizer`: the optimizer zeroshard builds when the script passes none."""

    type: str
    """Canonical name: "Adam", "AdamW", "Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", or a
    `torch.optim` class name ("SGD", "Adagrad", ...). Matched case-insensitively, as DeepSpeed does."""
    params: OptimizerParams
    """Constructor arguments: `AdamParams`, `LambParams`, or for other `torch.optim` classes a
    read-only mapping of the given keyword arguments (names checked against the signature)."""
    legacy_fusion: bool = False
    """DeepSpeed's legacy fused-optimizer path."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupLRParams:
    """`scheduler.params` for WarmupLR: warm up from min to max lr, then hold."""

    warmup_min_lr: float = spec(0.0, ge=0.0)
    """Learning rate at step 0."""
    warmup_max_lr: float | None = spec(None, ge=0.0)
    """Learning rate reached after warmup. Default null: the optimizer's lr, as DeepSpeed's
    WarmupLR does ("auto" copies optimizer.params.lr)."""
    warmup_num_steps: int = spec(1000, ge=1)
    """Optimizer steps of warmup."""
    warmup_type: WarmupType = "log"
    """Warmup curve: "log" (DeepSpeed's default) or "linear"."""
    last_batch_iteration: int = spec(-1, ge=-1)
    """Step to resume from; -1 starts fresh."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupDecayLRParams:
    """`scheduler.params` for WarmupDecayLR: warm up, then decay linearly to 0 at total_num_steps."""

    total_num_steps: int = spec(ge=1)
    """Optimizer steps of the whole run (required): the lr reaches 0 here."""
    warmup_min_lr: float = spec(0.0, ge=0.0)
    """Learning rate at step 0."""
    warmup_max_lr: float = spec(0.001, ge=0.0)
    """Learning rate reached after warmup. DeepSpeed's default, 0.001."""
    warmup_num_steps: int = spec(1000, ge=1)
    """Optimizer steps of warmup."""
    warmup_type: WarmupType = "log"
    """Warmup curve: "log" or "linear"."""
    last_batch_iteration: int = spec(-1, ge=-1)
    """Step to resume from; -1 starts fresh."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupCosineLRParams:
    """`scheduler.params` for WarmupCosineLR: warm up as a ratio of the optimizer's lr, then cosine."""

    total_num_steps: int = spec(ge=1)
    """Optimizer steps of the whole run (required)."""
    warmup_min_ratio: float = spec(0.0, ge=0.0)
    """lr at step 0, as a fraction of the optimizer's lr."""
    warmup_num_steps: int = spec(1000, ge=1)
    """Optimizer steps of warmup."""
    cos_min_ratio: float = spec(0.0001, ge=0.0)
    """lr at the end of the cosine, as a fraction of the optimizer's lr."""
    warmup_type: WarmupType = "log"
    """Warmup curve: "log" or "linear"."""
    last_batch_iteration: int = spec(-1, ge=-1)
    """Step to resume from; -1 starts fresh."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OneCycleParams:
    """`scheduler.params` for OneCycle: a 1cycle lr (and momentum) policy, then optional decay."""

    cycle_min_lr: float = spec(ge=0.0)
    """Lowest lr of the cycle (required)."""
    cycle_max_lr: float = spec(ge=0.0)
    """Highest lr of the cycle (required)."""
    decay_lr_rate: float = spec(0.0, ge=0.0)
    """lr decay rate after the cycle."""
    cycle_first_step_size: int = spec(2000, ge=1)
    """Steps of the increasing half of the cycle."""
    cycle_second_step_size: int | None = spec(None, ge=0)
    """Steps of the decreasing half; null = same as cycle_first_step_size; 0 = no decreasing half
    (the lr rises over the whole cycle, as in DeepSpeed)."""
    cycle_first_stair_count: int = spec(0, ge=0)
    """Stairs in the first half; 0 = continuous."""
    cycle_second_stair_count: int | None = spec(None, ge=0)
    """Stairs in the second half; null = same as cycle_first_stair_count."""
    decay_step_size: int = spec(0, ge=0)
    """Steps between decays after the cycle; 0 = no decay."""
    cycle_momentum: bool = True
    """Cycle momentum inversely to the lr."""
    cycle_min_mom: float = spec(0.8, ge=0.0)
    """Lowest momentum of the cycle."""
    cycle_max_mom: float = spec(0.9, ge=0.0)
    """Highest momentum of the cycle."""
    decay_mom_rate: float = spec(0.0, ge=0.0)
    """Momentum decay rate after the cycle."""
    last_batch_iteration: int = spec(-1, ge=-1)
    """Step to resume from; -1 starts fresh."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LRRangeTestParams:
    """`scheduler.params` for LRRangeTest: grow the lr to find a good range."""

    lr_range_test_min_lr: float = spec(1e-3, ge=0.0)
    """Starting learning rate."""
    lr_range_test_step_size: int = spec(2000, ge=1)
    """Steps per lr increase interval."""
    lr_range_test_step_rate: float = spec(1.0, ge=0.0)
    """lr growth per interval."""
    lr_range_test_staircase: bool = False
    """Grow in steps (true) or continuously (false)."""
    last_batch_iteration: int = spec(-1, ge=-1)
    """Step to resume from; -1 starts fresh."""


SchedulerParams = (
    WarmupLRParams | WarmupDecayLRParams | WarmupCosineLRParams | OneCycleParams | LRRangeTestParams
    | Mapping[str, Any]
)


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerConfig:
    """`scheduler`: the lr schedule zeroshard builds and steps once per optimizer step."""

    type: str
    """Canonical name: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, or a
    `torch.optim.lr_scheduler` class name (matched case-insensitively)."""
    params: SchedulerParams
    """Constructor arguments: one of the typed params classes above, or for a torch scheduler
    a read-only mapping of the given keyword arguments (names checked against the signature)."""


OPTIMIZER_PARAMS: dict[str, tuple[str, type]] = {
    "adam": ("Adam", AdamParams),
    "adamw": ("AdamW", AdamParams),
    "lamb": ("Lamb", LambParams),
    "onebitadam": ("OneBitAdam", OneBitAdamParams),
    "zerooneadam": ("ZeroOneAdam", ZeroOneAdamParams),
    "onebitlamb": ("OneBitLamb", OneBitLambParams),
}
"""DeepSpeed's own optimizer types with typed params: lower-case name -> (canonical, class)."""

SCHEDULER_PARAMS: dict[str, tuple[str, type]] = {
    "warmuplr": ("WarmupLR", WarmupLRParams),
    "warmupdecaylr": ("WarmupDecayLR", WarmupDecayLRParams),
    "warmupcosinelr": ("WarmupCosineLR", WarmupCosineLRParams),
    "onecycle": ("OneCycle", OneCycleParams),
    "lrrangetest": ("LRRangeTest", LRRangeTestParams),
}
"""DeepSpeed's schedulers: lower-case name -> (canonical, params class)."""
