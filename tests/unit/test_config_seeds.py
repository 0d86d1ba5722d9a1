"""The ds_config examples of the seed documents (shared/seeds/*.txt) load as DeepSpeed users expect.

Each config either loads, or fails only with "not supported yet: <key>" for NVMe offload or ZeRO++.
Not-supported checks run last (after parsing, "auto", the batch triad and stage applicability), so
reaching one proves the rest of the file is valid.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from zeroshard.config import Config, load_config
from zeroshard.errors import ConfigError, NotSupportedError

# seed 002 (DeepSpeed config walkthrough): stage examples, fp16 block, experiment config.
SEED002_ZERO2 = {"zero_optimization": {
    "stage": 2, "allgather_partitions": True, "allgather_bucket_size": 3e8, "overlap_comm": True,
    "reduce_scatter": True, "reduce_bucket_size": 3e8, "contiguous_gradients": True}}
SEED002_ZERO3 = {"zero_optimization": {
    "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
    "sub_group_size": 1e9, "reduce_bucket_size": 1e6, "stage3_prefetch_bucket_size": 4e6,
    "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True}}
SEED002_NVME = {"zero_optimization": {
    "stage": 3,
    "offload_optimizer": {"device": "nvme", "nvme_path": "/dev/shm", "buffer_count": 4, "fast_init": False},
    "offload_param": {"device": "nvme", "nvme_path": "/dev/shm", "buffer_count": 5, "buffer_size": 1e8,
                      "max_in_cpu": 1e9}}}
SEED002_FP16_AND_LOGGING = {
    "fp16": {"enabled": True, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16,
             "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1},
    "gradient_clipping": 1.0, "steps_per_print": 10, "wall_clock_breakdown": False, "dump_state": False,
    "train_batch_size": "auto", "gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": "auto",
    "optimizer": {"type": "Adam", "params": {"lr": "auto", "betas": [0.9, 0.95], "eps": "auto",
                                             "weight_decay": "auto", "torch_adam": True, "adam_w_mode": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 5e-6, "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
}
SEED002_EXPERIMENT = {
    "train_batch_size": "auto",
    "optimizer": {"type": "Adam", "params": {"lr": "auto", "betas": [0.9, 0.95], "eps": "auto",
                                             "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 5e-6, "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "steps_per_print": 10, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
    **SEED002_ZERO3,
    "gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
# seed 003: AdamW + fp16 + stage 3; OneBitAdam; DeepSpeed-Chat's get_train_ds_config(offload=False).
SEED003_ADAMW_STAGE3 = {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}, "optimizer": {
    "type": "AdamW", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}}}
SEED003_ONEBIT = {"optimizer": {"type": "OneBitAdam", "params": {
    "lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7, "freeze_step": 400,
    "cuda_aware": False, "comm_backend_name": "nccl"}}}


def seed003_chat(stage: int) -> dict[str, Any]:
    return {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
        "zero_optimization": {"stage": stage, "offload_param": {"device": "none"},
                              "offload_optimizer": {"device": "none"}, "stage3_param_persistence_threshold": 1e4,
                              "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                              "memory_efficient_linear": False},
        "fp16": {"enabled": True, "loss_scale_window": 100}, "gradient_clipping": 1.0,
        "prescale_gradients": False, "wall_clock_breakdown": False,
    }


# seed 004 (HF Transformers / Accelerate integration).
HF_FP16 = {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
           "hysteresis": 2, "min_loss_scale": 1}
HF_SCHEDULER = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                    "warmup_num_steps": "auto", "total_num_steps": "auto"}}
HF_TAIL = {"gradient_accumulation_steps": 1, "gradient_clipping": "auto", "steps_per_print": 2000,
           "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}
SEED004_ZERO2 = {
    "fp16": {**HF_FP16, "enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True,
                                              "adam_w_mode": True}},
    "scheduler": HF_SCHEDULER,
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": "auto",
                          "contiguous_gradients": True},
    **HF_TAIL,
}
SEED004_ZERO3 = {
    "fp16": {**HF_FP16, "enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": HF_SCHEDULER,
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
        "contiguous_gradients": True, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "sub_group_size": 1e9, "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": "auto"},
    **HF_TAIL,
}
SEED004_ZEROPP = {"train_batch_size": 8, "zero_optimization": {
    "stage": 3, "reduce_bucket_size": "auto", "zero_quantized_weights": True, "zero_hpz_partition_size": 8,
    "zero_quantized_gradients": True, "contiguous_gradients": True, "overlap_comm": True}}
SEED004_ACCELERATE_BF16 = {
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False,
                          "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}},
    "gradient_clipping": 1.0, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": 10, "steps_per_print": 2000000,
}
SEED004_ACCELERATE_AUTO = {
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": "auto", "stage3_gather_16bit_weights_on_model_save": "auto",
                          "offload_optimizer": {"device": "auto"}, "offload_param": {"device": "auto"}},
    "gradient_clipping": "auto", "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "steps_per_print": 2000000,
}

HF_AUTO_VALUES: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
    "optimizer.params.lr": 5e-5, "optimizer.params.weight_decay": 0.0, "optimizer.params.eps": 1e-8,
    "scheduler.params.warmup_num_steps": 100, "scheduler.params.total_num_steps": 1000,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": True,
}


def load(raw: dict[str, Any], **kwargs: Any) -> Config:
    kwargs.setdefault("dp_world_size", 2)
    return load_config({"train_micro_batch_size_per_gpu": 1, **raw}, **kwargs)


@pytest.mark.parametrize("raw, stage, kwargs, unsupported", [
    ({"zero_optimization": {"stage": 1}}, 1, {}, None),
    (SEED002_ZERO2, 2, {}, None),
    (SEED002_ZERO3, 3, {}, None),
    (SEED002_NVME, 3, {}, None),
    (SEED002_EXPERIMENT, 3, {"auto_values": HF_AUTO_VALUES}, None),
    (SEED003_ADAMW_STAGE3, 3, {}, None),
    (seed003_chat(3), 3, {}, None),
    (SEED004_ZERO2, 2, {"auto_values": HF_AUTO_VALUES, "hidden_size": 4096}, None),
    (SEED004_ZERO3, 3, {"auto_values": HF_AUTO_VALUES, "hidden_size": 4096}, None),
    (SEED004_ZEROPP, 3, {"hidden_size": 1024}, None),
    (SEED004_ACCELERATE_BF16, 3, {"auto_values": HF_AUTO_VALUES}, None),
    (SEED004_ACCELERATE_AUTO, 3, {"auto_values": {**HF_AUTO_VALUES, "zero_optimization.stage": 3,
                                                  "zero_optimization.offload_optimizer.device": "cpu"}}, None),
])
def test_seed_configs_load(raw: dict[str, Any], stage: int, kwargs: dict[str, Any], unsupported: str | None) -> None:
    """Every seed config loads as written, except the features zeroshard refuses by name
    (NVMe offload, ZeRO++)."""
    if unsupported is None:
        assert load(raw, **kwargs).zero_optimization.stage == stage
        return
    with pytest.raises(NotSupportedError, match=rf"^not supported yet: {re.escape(unsupported)}="):
        load(raw, **kwargs)


def test_seed_stage0_and_fp16_configs_load() -> None:
    cfg = load({"zero_optimization": {"stage": 0}, "train_batch_size": 8})
    assert (cfg.zero_optimization.stage, cfg.gradient_accumulation_steps) == (0, 4)
    cfg = load(SEED002_FP16_AND_LOGGING, auto_values=HF_AUTO_VALUES)
    assert cfg.precision == "fp16" and cfg.optimizer.params.betas == (0.9, 0.95)
    assert cfg.scheduler.params.warmup_max_lr == 5e-5 and cfg.scheduler.params.warmup_min_lr == 5e-6
    assert (cfg.train_batch_size, cfg.steps_per_print, cfg.gradient_clipping) == (8, 10, 1.0)


def test_hf_zero2_config_at_stage0_resolves_every_auto() -> None:
    raw = {**SEED004_ZERO2, "zero_optimization": {"stage": 0, "overlap_comm": True, "reduce_bucket_size": "auto",
                                                  "contiguous_gradients": True}}
    cfg = load(raw, auto_values=HF_AUTO_VALUES, hidden_size=4096)
    assert cfg.zero_optimization.reduce_bucket_size == 4096 * 4096
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.params.lr == 5e-5
    assert cfg.scheduler.params.total_num_steps == 1000 and cfg.scheduler.params.warmup_min_lr == 0.0
    assert "# auto (from initialize arguments)" in cfg.describe()


def test_accelerate_stage_auto_needs_a_value() -> None:
    with pytest.raises(ConfigError, match=r'zero_optimization\.stage: is "auto" but initialize\(\) supplied no '
                                          r"value for it; set it to 0, 1, 2 or 3\."):
        load(SEED004_ACCELERATE_AUTO, auto_values={"gradient_clipping": 1.0})


def test_onebit_adam_seed_config_loads() -> None:
    """Seed 003's 1-bit Adam section loads as written (stage 0, DeepSpeed's "nccl" backend name);
    with ZeRO partitioning it is refused by name, as DeepSpeed refuses it."""
    cfg = load(SEED003_ONEBIT)
    assert cfg.optimizer.type == "OneBitAdam"
    assert cfg.optimizer.params.freeze_step == 400 and cfg.optimizer.params.betas == (0.8, 0.999)
    assert cfg.optimizer.params.comm_backend_name == "nccl"
    with pytest.raises(ConfigError, match=r"optimizer\.type OneBitAdam applies to zero_optimization\.stage 0 "
                                          r"only .* you chose stage 1"):
        load({**SEED003_ONEBIT, "zero_optimization": {"stage": 1}})
    with pytest.raises(ConfigError, match=r"optimizer\.params\.comm_backend_name"):
        load({"optimizer": {"type": "OneBitAdam", "params": {"comm_backend_name": "mpi"}}})


def test_deepspeed_chat_stage2_config_sets_stage3_keys() -> None:
    """DeepSpeed-Chat passes stage-3 tuning keys at stage 2, where DeepSpeed ignores them: the
    template loads, with one note naming the keys that have no effect at stage 2."""
    cfg = load(seed003_chat(2))
    assert cfg.zero_optimization.stage == 2
    (note,) = cfg.notes
    assert note.startswith("zero_optimization: set for another ZeRO stage, no effect at stage 2: ")
    assert "stage3_prefetch_bucket_size (stage 3)" in note


def test_hf_t0_inference_config_needs_integral_bucket_sizes() -> None:
    """seed 001 computes 0.9 * d_model**2 as a float; a non-integral element count is an error."""
    d_model = 1024
    zero = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
            "contiguous_gradients": True, "reduce_bucket_size": d_model * d_model,
            "stage3_prefetch_bucket_size": 0.9 * d_model * d_model, "stage3_param_persistence_threshold": 10 * d_model}
    raw = {"fp16": {"enabled": False}, "bf16": {"enabled": False}, "zero_optimization": zero,
           "steps_per_print": 2000, "train_batch_size": 2, "wall_clock_breakdown": False}
    with pytest.raises(ConfigError, match=r"stage3_prefetch_bucket_size: got 943718\.4, expected an integer"):
        load(raw)
    zero["stage3_prefetch_bucket_size"] = int(0.9 * d_model * d_model)
    assert load(raw).zero_optimization.stage3_prefetch_bucket_size == 943718
