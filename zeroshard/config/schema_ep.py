"""`expert_parallel`: DeepSpeed 0.19.8's AutoEP section, typed (see zeroshard/moe/hf_experts.py).

Key names and defaults follow DeepSpeed's `parse_autoep_config`. zeroshard's AutoEP keeps the
model's own router and expert maths and cuts only each transformers-5 expert bank to this rank's
experts, so the keys that describe a router or a custom expert layout to DeepSpeed stay at their
"auto" / null defaults (support.py refuses other values by name), and the kernel and transport
tuning keys are accepted without effect (effects.py). Imports nothing of zeroshard outside
config/ but `errors`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zeroshard.config.fields import show, spec
from zeroshard.errors import ConfigError

PRESETS: dict[str, tuple[str, ...]] = {
    "mixtral": ("mixtral",),
    "qwen3_moe": ("qwen3_moe",),
    "qwen3_5_moe": ("qwen3_5_moe", "qwen3_5_moe_text"),
    "deepseek_v2": ("deepseek_v2",),
    "deepseek_v3": ("deepseek_v3",),
    "minimax_m3": ("minimax_m3",),
}
"""DeepSpeed 0.19.8's `preset_model` names -> the transformers `model_type`s each describes. zeroshard
finds the expert banks by their structure; a preset is checked against the model's type."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertParallelConfig:
    """`expert_parallel`: AutoEP, expert parallelism for Hugging Face MoE models without model edits."""

    enabled: bool = False
    """Cut every expert bank of the model over `autoep_size` ranks at `initialize`."""
    autoep_size: int = spec(1, ge=1)
    """Expert-parallel size: ranks that split each layer's experts; it must divide the
    data-parallel size and the number of experts. The ranks holding the same experts form the
    expert-data-parallel group (DeepSpeed's layout, moe/ep_groups.py)."""
    preset_model: str | None = None
    """DeepSpeed's model preset (mixtral, qwen3_moe, qwen3_5_moe, deepseek_v2, deepseek_v3,
    minimax_m3). zeroshard finds the banks by structure (any transformers-5 experts module, GPT-OSS
    included) and checks a given preset against the model's `model_type`."""
    use_grouped_mm: bool = True
    """DeepSpeed: grouped GEMM for the local experts. The local experts run the model's own experts
    implementation (`config._experts_implementation`: eager, batched_mm, grouped_mm)."""
    disable_triton_grouped_mm: bool = False
    """DeepSpeed's Triton kernel switch (no Triton kernel in zeroshard)."""
    expert_tensor_parallel_size: int = spec(1, ge=1)
    """Tensor parallelism inside each expert."""
    validate_folding_routing: bool = False
    """DeepSpeed's AutoEP x AutoTP folding check."""
    async_split_plan: bool = False
    """DeepSpeed's asynchronous split-size exchange."""
    top_k: Any = "auto"
    """Experts per token; "auto": the model's router."""
    score_func: str = "auto"
    """Router scores (softmax / sigmoid); "auto": the model's router."""
    route_norm: bool | None = None
    """Normalise the top-k weights; null: the model's router."""
    route_scale: float = 1.0
    """A factor on the routing weights; 1.0: the model's router (its routed scaling)."""
    routed_scaling_factor: Any = "auto"
    """DeepSeek's routed scaling factor; "auto": the model's router."""
    num_expert_groups: int | None = None
    """Group-limited routing's groups; null: the model's router."""
    num_limited_groups: int | None = None
    """Group-limited routing's chosen groups; null: the model's router."""
    score_apply: str = "auto"
    """Where DeepSpeed applies the scores; the routing weights weight each expert's output."""
    combine_impl: str = "auto"
    """DeepSpeed's combine kernel choice."""
    row_weighting_impl: str = "auto"
    """DeepSpeed's row-weighting kernel choice."""
    gate_up_impl: str = "separate"
    """DeepSpeed's gate/up projection kernel choice."""
    comm_backend: str = "comm"
    """Token transport: "comm" (all-to-all over the expert-parallel group)."""
    comm_num_sm: int = 12
    """DeepEP's streaming multiprocessors (DeepEP only)."""
    comm_qp_margin: int = 4
    """DeepEP's queue-pair margin (DeepEP only)."""
    comm_max_tokens_per_rank: int = 0
    """DeepEP's token budget (DeepEP only)."""
    load_balance_coeff: float | None = None
    """Auxiliary-loss-free balancing (DeepSeek-V3): after each optimizer step every router's selection
    bias (`e_score_correction_bias`) moves by this much towards balance, sign(mean load - load) per
    expert, centred (moe/balance.py). Acted on for routers with such a bias (DeepSeek-V3, GLM-4.5-MoE,
    dots1, ...), with or without expert parallelism; null: off. DeepSpeed 0.19.8 refuses the key."""
    moe_layer_pattern: str | None = None
    """DeepSpeed's custom-model description: the MoE block's module pattern."""
    expert_pattern: str | None = None
    """DeepSpeed's custom-model description: the experts module's pattern."""
    router_pattern: str | None = None
    """DeepSpeed's custom-model description: the router's pattern."""
    expert_w1: str | None = None
    """DeepSpeed's custom-model description: the first expert weight's name."""
    expert_w2: str | None = None
    """DeepSpeed's custom-model description: the second expert weight's name."""
    expert_w3: str | None = None
    """DeepSpeed's custom-model description: the third expert weight's name."""
    num_experts_attr: str | None = None
    """DeepSpeed's custom-model description: the attribute holding the number of experts."""
    top_k_attr: str | None = None
    """DeepSpeed's custom-model description: the attribute holding top-k."""
    has_shared_experts: bool | None = None
    """DeepSpeed's custom-model description: whether shared experts exist (they stay dense here)."""
    shared_experts_pattern: str | None = None
    """DeepSpeed's custom-model description: the shared experts' pattern."""
    shared_experts_gate_pattern: str | None = None
    """DeepSpeed's custom-model description: the shared experts' gate pattern."""
    expert_activation: str | None = None
    """DeepSpeed's custom-model description: the experts' activation."""

    @property
    def size(self) -> int:
        """The expert-parallel size AutoEP asks for: `autoep_size` when enabled, else 1."""
        return self.autoep_size if self.enabled else 1


def check_expert_parallel(ep: ExpertParallelConfig) -> None:
    """A preset zeroshard does not know, at load time (the model's type is checked at initialize).

    Raises:
        ConfigError: an unknown `preset_model`.
    """
    if ep.preset_model is not None and ep.preset_model not in PRESETS:
        raise ConfigError(f"expert_parallel.preset_model: got {show(ep.preset_model)}, expected one of "
                          f"{', '.join(show(p) for p in PRESETS)} (or null: the banks are found by structure).")


def expert_parallel_size_of(raw_config: Any) -> int:
    """`expert_parallel.autoep_size` of a raw config dict when enabled, else 1, read before the
    config is parsed: the parallel dimensions are decided first (runtime/initialize.py)."""
    section = raw_config.get("expert_parallel") if hasattr(raw_config, "get") else None
    if not hasattr(section, "get") or section.get("enabled") is not True:
        return 1
    size = section.get("autoep_size", 1)
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else 1
