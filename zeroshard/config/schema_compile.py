"""`compile`: DeepSpeed 0.19.8's `CompileConfig` section, typed (see runtime/compile.py).

Every key tunes DeepCompile (DeepSpeed's own compiler passes for ZeRO) or AutoEP's regional
compile; DeepSpeed reads none of them for a plain `engine.compile()`. zeroshard's `engine.compile()`
is that plain path (torch.compile of the wrapped model, zeroshard's hooks kept eager), so every key
is accepted at its default and refused by name otherwise (config/support.py). Imports nothing of
zeroshard outside config/.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from zeroshard.config.fields import spec

CompilePass = Literal["z1", "z3", "autosp", "autotp"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CompileConfig:
    """`compile`: DeepSpeed's DeepCompile options. Call `engine.compile()` to compile the model;
    this section does not turn compilation on (in DeepSpeed neither)."""

    deepcompile: bool = False
    """DeepSpeed's DeepCompile: its own graph passes that schedule ZeRO's gathers and reductions
    inside the compiled graph (GPU-oriented, DeepSpeed-internal). Not implemented: true is refused;
    `engine.compile()` compiles the model with zeroshard's hooks and collectives kept eager."""
    autoep_non_moe: bool = False
    """Compile the parents of AutoEP layers, keeping the expert layers eager. AutoEP (expert
    parallelism) is not implemented, so true is refused."""
    free_activation: bool = False
    """DeepCompile: free activations eagerly. Refused unless false (DeepCompile only)."""
    free_activation_threshold: int = spec(10 * 1024 * 1024, ge=0)
    """DeepCompile: bytes from which free_activation frees an activation. DeepCompile only."""
    offload_activation: bool = False
    """DeepCompile: move saved activations to host memory. DeepCompile only."""
    offload_activation_pin_memory: bool = True
    """DeepCompile: pin the host buffers of offload_activation. DeepCompile only."""
    offload_opt_states: bool = False
    """DeepCompile: offload optimizer states during forward/backward. DeepCompile only (zeroshard's
    `zero_optimization.offload_optimizer` keeps them on the CPU throughout)."""
    double_buffer: bool = True
    """DeepCompile: double-buffer its gathers. DeepCompile only."""
    symmetric_memory: bool = False
    """DeepCompile: gather into symmetric memory (NVSHMEM). DeepCompile only."""
    debug_log: bool = False
    """DeepCompile: dump its graphs. DeepCompile only (torch's TORCH_LOGS="graph_breaks,recompiles"
    shows what zeroshard's engine.compile() does)."""
    offload_parameters: bool = False
    """DeepCompile: offload parameters. DeepCompile only (zeroshard's
    `zero_optimization.offload_param` offloads them)."""
    sync_before_reduce: bool = False
    """DeepCompile: synchronize the device before each reduction. DeepCompile only."""
    sync_after_reduce: bool = False
    """DeepCompile: synchronize the device after each reduction. DeepCompile only."""
    sync_before_allgather: bool = False
    """DeepCompile: synchronize the device before each all-gather. DeepCompile only."""
    sync_after_allgather: bool = False
    """DeepCompile: synchronize the device after each all-gather. DeepCompile only."""
    keep_int_input_tensors: bool = True
    """DeepCompile: keep the values of integer graph inputs when profiling. DeepCompile only."""
    keep_all_input_tensors: bool = False
    """DeepCompile: keep the values of every graph input when profiling. DeepCompile only."""
    passes: tuple[CompilePass, ...] | None = None
    """DeepCompile: which of its passes to compose ("z1", "z3", "autosp", "autotp"). DeepCompile only."""
