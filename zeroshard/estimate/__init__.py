"""Memory model and plan search: arithmetic on a Config, never a process group or a weight.

    from zeroshard.estimate import spec_from_module, Setup, estimate_rank
    est = estimate_rank(spec_from_module(model), Setup(zero_stage=2, precision="bf16", devices_per_node=8))
    est.device.total, est.host.total      # bytes per rank on the device / offloaded to the CPU

DeepSpeed's estimator API is here under its names (`estimate_zero2_model_states_mem_needs_all_live`
and the rest); `zeroshard estimate` and `zeroshard plan` are the command-line faces. See
docs/estimate.md. Imports `zeroshard.config`, `zeroshard.zero` (layout rules), `zeroshard.comm.parallel_dims`
(the layout's sizes, pure integers), torch, the built-in GPT
(`zeroshard.examples.gpt`), `zeroshard.moe` (which modules are expert banks, in experts.py) and, in
probe_worker.py only, `zeroshard.runtime` (it trains).
"""

from zeroshard.estimate.activations import ActivationOptions, activation_bytes
from zeroshard.estimate.deepspeed_compat import (
    EstimateRow,
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from zeroshard.estimate.model_source import load_model_spec, spec_from_hf_config
from zeroshard.estimate.plan import Decision, Hardware, Plan, Workload, make_plan
from zeroshard.estimate.spec import ModelSpec, TransformerShape, spec_from_counts, spec_from_gpt, spec_from_module
from zeroshard.estimate.states import NodeEstimate, RankEstimate, Setup, StateBytes, estimate_node, estimate_rank
from zeroshard.estimate.table import zero_stage_supported

__all__ = [
    "ActivationOptions",
    "Decision",
    "EstimateRow",
    "Hardware",
    "ModelSpec",
    "NodeEstimate",
    "Plan",
    "RankEstimate",
    "Setup",
    "StateBytes",
    "TransformerShape",
    "Workload",
    "activation_bytes",
    "estimate_node",
    "estimate_rank",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "load_model_spec",
    "make_plan",
    "spec_from_counts",
    "spec_from_gpt",
    "spec_from_hf_config",
    "spec_from_module",
    "zero_stage_supported",
]
