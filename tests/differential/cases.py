"""The differential cases: one ds_config each, run verbatim through DeepSpeed and zeroshard.

Every case trains the tiny GPT of `zeroshard.examples.gpt` at world size 2 for `STEPS`
optimizer steps, saves a checkpoint after step `SAVE_AT`, and a fresh engine loads it and runs
the remaining steps. `worker.py` runs the cases under one engine; `compare.py` compares.

A case is a name, a config built by `make_config(**overrides)`, and optionally a client
optimizer, a per-precision tolerance and an expected-failure reason (`xfail`), which the table
prints next to the case so a known deviation stays visible.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal

STEPS = 6
"""Optimizer steps per case: enough for warm-up schedules and fp16 skips to show."""
SAVE_AT = 3
"""Checkpoint after this step; a fresh engine loads it and runs steps SAVE_AT+1 .. STEPS."""
WORLD_SIZE = 2

Precision = Literal["fp32", "bf16", "fp16"]

# Relative tolerance on the loss and the pre-clip gradient norm per precision (issue 9);
# lr and betas are compared to LR_TOL. Final fp32 master weights: WEIGHT_TOL (max abs).
LOSS_TOL: dict[str, float] = {"fp32": 1e-5, "bf16": 2e-3, "fp16": 2e-3}
LR_TOL = 1e-6
WEIGHT_TOL: dict[str, float] = {"fp32": 1e-5, "bf16": 2e-3, "fp16": 2e-3}

_ABSENT = object()


class _Replace(dict):  # type: ignore[type-arg]
    """A dict value that replaces the base's instead of merging into it."""


@dataclass(frozen=True)
class Case:
    name: str
    config: dict[str, Any]
    client_optimizer: str | None = None
    """"adamw" or "sgd": a torch optimizer built by the test and passed as optimizer=."""
    xfail: str | None = None
    """Why this case is expected to deviate (and must: the test fails if it starts to match)."""
    ds_reference: str | None = None
    """Compare with DeepSpeed's run of this other case instead of its run of this one: set
    where DeepSpeed has a documented defect in this configuration and computes the same
    training correctly in another (docs/deepspeed-differences.md). The table also shows how
    far DeepSpeed's own run of this case is from that reference."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def precision(self) -> Precision:
        if self.config.get("bf16", {}).get("enabled"):
            return "bf16"
        if self.config.get("fp16", {}).get("enabled"):
            return "fp16"
        return "fp32"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if value is _ABSENT:
            out.pop(key, None)
        elif isinstance(value, _Replace):
            out[key] = copy.deepcopy(dict(value))
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


BASE: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                              "weight_decay": 0.1}},
    "zero_optimization": {"stage": 0},
    "steps_per_print": 1000,
}

FP16 = {"fp16": {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 1000,
                 "hysteresis": 2, "min_loss_scale": 1}}
BF16 = {"bf16": {"enabled": True}}


def make_config(**over: Any) -> dict[str, Any]:
    """BASE with `over` merged in (nested dicts merge; the value ABSENT removes a key)."""
    return _merge(BASE, over)


def _zero(stage: int, **extra: Any) -> dict[str, Any]:
    return {"zero_optimization": {"stage": stage, **extra}}


def _opt(type_: str, **params: Any) -> dict[str, Any]:
    return {"optimizer": _Replace(type=type_, params={"lr": 1e-3, **params})}


def _sched(type_: str, **params: Any) -> dict[str, Any]:
    return {"scheduler": {"type": type_, "params": params}}


def _ds_stage0_defect(stage: int, twin: str) -> dict[str, Any]:
    """DeepSpeed's stage-0 mixed-precision optimizers (BF16_Optimizer, FP16_Optimizer without
    ZeRO) train differently from its own stages 1-3 (docs/deepspeed-differences.md,
    "Differential test suite"); zeroshard's stage 0 is compared with DeepSpeed's ZeRO twin."""
    return {"ds_reference": twin} if stage == 0 else {}


def _cases() -> list[Case]:
    cases: list[Case] = []

    def add(name: str, *parts: dict[str, Any], **kw: Any) -> None:
        config = BASE
        for part in parts:
            config = _merge(config, part)
        cases.append(Case(name, config, **kw))

    # Stages x precision.
    for stage in range(4):
        add(f"s{stage}_fp32", _zero(stage))
        add(f"s{stage}_bf16", _zero(stage), BF16, **_ds_stage0_defect(stage, "s1_bf16"))
        add(f"s{stage}_fp16", _zero(stage), FP16, **_ds_stage0_defect(stage, "s1_fp16"))
    # fp16 dynamic loss scaling with skipped steps: a scale far too large at the start.
    add("s2_fp16_overflow", _zero(2), FP16, {"fp16": {"initial_scale_power": 30, "hysteresis": 1}})
    add("s0_fp16_overflow", _zero(0), FP16, {"fp16": {"initial_scale_power": 30, "hysteresis": 1}},
        **_ds_stage0_defect(0, "s2_fp16_overflow"))
    # A scale that overflows for the first steps only, then trains; hysteresis 2 (the default).
    add("s1_fp16_overflow_recover", _zero(1), FP16, {"fp16": {"initial_scale_power": 19}})
    add("s3_fp16_overflow_recover", _zero(3), FP16, {"fp16": {"initial_scale_power": 19}})
    # Growth: after loss_scale_window clean steps the scale doubles (compared up to that step).
    add("s2_fp16_growth", _zero(2), FP16, {"fp16": {"loss_scale_window": 2}})
    # Offload: CPU optimizer (stage 1-3) and parameters (stage 3).
    off_opt = {"offload_optimizer": {"device": "cpu"}}
    off_par = {"offload_param": {"device": "cpu"}}
    add("s1_offload_opt", _zero(1, **off_opt))
    add("s2_offload_opt", _zero(2, **off_opt))
    add("s2_offload_opt_bf16", _zero(2, **off_opt), BF16)
    add("s3_offload_opt", _zero(3, **off_opt))
    add("s3_offload_opt_param", _zero(3, **off_opt, **off_par))
    add("s3_offload_opt_param_bf16", _zero(3, **off_opt, **off_par), BF16)
    # Optimizers (stage 2, fp32).
    add("opt_adam", _zero(2), _opt("Adam", weight_decay=0.1))
    add("opt_adam_l2", _zero(2), _opt("Adam", weight_decay=0.1, adam_w_mode=False))
    add("opt_adamw_wd0", _zero(2), _opt("AdamW", weight_decay=0.0))
    add("opt_adam_wd0_s0", _zero(0), _opt("Adam", weight_decay=0.0))
    # DeepSpeed wants zero_allow_untested_optimizer for anything but its Adam/Lamb at ZeRO.
    untested = {"zero_allow_untested_optimizer": True}
    add("opt_torch_sgd", _zero(2), _opt("SGD", momentum=0.9, weight_decay=0.1), untested)
    add("opt_torch_rmsprop_s1", _zero(1), _opt("RMSprop", alpha=0.9), untested)
    add("opt_client_adamw", _zero(2), {"optimizer": _ABSENT}, client_optimizer="adamw")
    add("opt_client_sgd_s3", _zero(3), {"optimizer": _ABSENT}, untested, client_optimizer="sgd")
    # Schedulers (stage 1, fp32).
    add("lr_warmup_log", _zero(1), _sched("WarmupLR", warmup_min_lr=0.0, warmup_max_lr=1e-3,
                                          warmup_num_steps=4))
    add("lr_warmup_linear", _zero(1), _sched("WarmupLR", warmup_min_lr=1e-5, warmup_max_lr=1e-3,
                                             warmup_num_steps=4, warmup_type="linear"))
    add("lr_warmup_decay", _zero(1), _sched("WarmupDecayLR", warmup_min_lr=0.0, warmup_max_lr=1e-3,
                                            warmup_num_steps=2, total_num_steps=8))
    add("lr_warmup_cosine", _zero(1), _sched("WarmupCosineLR", warmup_min_ratio=0.1,
                                             warmup_num_steps=2, total_num_steps=8,
                                             cos_min_ratio=0.01))
    add("lr_onecycle_momentum", _zero(1), _sched(
        "OneCycle", cycle_min_lr=1e-4, cycle_max_lr=1e-3, cycle_first_step_size=2,
        cycle_momentum=True, cycle_min_mom=0.85, cycle_max_mom=0.95, decay_step_size=1,
        decay_lr_rate=0.1, decay_mom_rate=0.1))  # DeepSpeed: betas = (momentum, 0.99)
    add("lr_onecycle_no_momentum", _zero(1), _sched(
        "OneCycle", cycle_min_lr=1e-4, cycle_max_lr=1e-3, cycle_first_step_size=2,
        cycle_momentum=False, decay_step_size=1, decay_lr_rate=0.1))
    add("lr_range_test", _zero(1), _sched("LRRangeTest", lr_range_test_min_lr=1e-4,
                                          lr_range_test_step_size=2, lr_range_test_step_rate=2.0))
    add("lr_range_test_staircase", _zero(1), _sched(
        "LRRangeTest", lr_range_test_min_lr=1e-4, lr_range_test_step_size=2,
        lr_range_test_step_rate=1.0, lr_range_test_staircase=True))
    add("lr_warmup_decay_s3_bf16", _zero(3), BF16, _sched(
        "WarmupDecayLR", warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=2,
        total_num_steps=8))
    # Gradient accumulation: micro batch x GAS, and a derived train_batch_size / GAS.
    add("ga_mb1_gas4_s0", _zero(0), {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4})
    add("ga_mb2_gas2_s2", _zero(2), {"gradient_accumulation_steps": 2})
    add("ga_mb1_gas3_s3", _zero(3), {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 3})
    add("ga_mb2_gas2_s1_bf16", _zero(1), BF16, {"gradient_accumulation_steps": 2})
    add("ga_mb2_gas2_s2_fp16", _zero(2), FP16, {"gradient_accumulation_steps": 2})
    add("ga_derived_gas", _zero(2), {"train_batch_size": 8, "gradient_accumulation_steps": _ABSENT})
    add("ga_derived_micro", _zero(1), {"train_batch_size": 8, "train_micro_batch_size_per_gpu": _ABSENT,
                                       "gradient_accumulation_steps": 2})
    # Clipping: absent (DeepSpeed's default), off, on, and tight enough to bind.
    add("clip_absent", _zero(2), {"gradient_clipping": _ABSENT})  # DeepSpeed's default: 1.0
    add("clip_0", _zero(2), {"gradient_clipping": 0.0})
    add("clip_1", _zero(1), {"gradient_clipping": 1.0})
    add("clip_tight_s3", _zero(3), {"gradient_clipping": 0.05})
    add("clip_tight_s1_bf16", _zero(1), BF16, {"gradient_clipping": 0.05})
    add("clip_tight_s0_bf16", _zero(0), BF16, {"gradient_clipping": 0.05},
        **_ds_stage0_defect(0, "clip_tight_s1_bf16"))
    # Gradient averaging and communication dtype.
    add("prescale_s0", _zero(0), {"prescale_gradients": True})
    # DeepSpeed's stage 2 refuses pre-scaling / pre-division with reduce_scatter (its default).
    add("prescale_s2", _zero(2, reduce_scatter=False), {"prescale_gradients": True})
    add("predivide_2_s0", _zero(0), {"prescale_gradients": True, "gradient_predivide_factor": 2.0})
    add("predivide_2_s2", _zero(2, reduce_scatter=False), {"gradient_predivide_factor": 2.0})
    add("comm_fp32_bf16_s2", _zero(2), BF16, {"communication_data_type": "fp32"})
    add("comm_bf16_bf16_s1", _zero(1), BF16, {"communication_data_type": "bf16"})
    add("comm_fp16_fp16_s2", _zero(2), FP16, {"communication_data_type": "fp16"})
    add("comm_fp32_fp16_s3", _zero(3), FP16, {"communication_data_type": "fp32"})
    return cases


CASES: list[Case] = _cases()
BY_NAME: dict[str, Case] = {c.name: c for c in CASES}
if len(BY_NAME) != len(CASES):
    raise AssertionError("duplicate case names")
