"""What every engine shares: hyper-parameters, the model, the data, the ds_config, the census.

One place defines the run so that no engine can drift: the same GPT (built from its config with
the same seed), the same token batches per rank and step, the same AdamW and clipping, the same
reduce bucket size. Imports torch and zeroshard's example model only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from zeroshard.examples.gpt import GPT, CharDataset, GPTConfig, load_corpus


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One benchmark run's settings, identical for every engine of a round."""

    model: str = "25m"
    """GPTConfig preset (25m: 8 layers, 512 wide, 256 tokens, ~25.5M parameters)."""
    micro_batch: int = 1
    """Sequences per rank per step (train_micro_batch_size_per_gpu)."""
    seq_len: int = 256
    """Tokens per sequence."""
    precision: str = "fp32"
    """"fp32" or "bf16" (bf16 weights and activations, fp32 master weights and optimizer)."""
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    bucket_numel: int = 5_000_000
    """reduce_bucket_size / allgather_bucket_size (elements); DDP's bucket_cap_mb is derived."""
    seed: int = 1234

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Stepper(Protocol):
    """One engine, built around the model: a full training step and what it holds."""

    optimizer_name: str
    """Class name of the optimizer that actually steps (e.g. FusedAdam, DeepSpeedCPUAdam)."""

    def step(self, x: Tensor, y: Tensor) -> Tensor:
        """Forward, backward, gradient clipping, optimizer step; returns the loss (detached)."""
        ...

    def census_roots(self) -> Iterable[Any]:
        """Objects whose tensors are the model states (see `tensor_census`)."""
        ...

    def reported_state_bytes(self) -> int | None:
        """Model-state bytes as the engine itself reports them, or None."""
        ...


def build_model(spec: RunSpec) -> GPT:
    """The benchmark GPT, identical on every rank and for every engine (seeded init)."""
    torch.manual_seed(spec.seed)
    cfg = GPTConfig.preset(spec.model)
    if spec.seq_len > cfg.block_size:
        raise ValueError(f"seq_len {spec.seq_len} > block_size {cfg.block_size} of preset {spec.model}")
    return GPT(cfg)


class Batches:
    """Corpus batches: step s on rank r reads the micro_batch windows starting at sample
    index (s * world_size + r) * micro_batch, wrapping around the corpus. Identical per engine."""

    def __init__(self, spec: RunSpec, rank: int, world_size: int) -> None:
        self._data = CharDataset(load_corpus(), spec.seq_len)
        self._spec, self._rank, self._world_size = spec, rank, world_size

    def __call__(self, step: int) -> tuple[Tensor, Tensor]:
        mb = self._spec.micro_batch
        first = (step * self._world_size + self._rank) * mb
        pairs = [self._data[(first + i) % len(self._data)] for i in range(mb)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def adamw_kwargs(spec: RunSpec) -> dict[str, Any]:
    return {"lr": spec.lr, "betas": spec.betas, "eps": spec.eps, "weight_decay": spec.weight_decay}


NVME_SUB_GROUP = 1_000_000
NVME_BUFFER_COUNT = 4


def ds_config(spec: RunSpec, stage: int, offload: bool | str) -> dict[str, Any]:
    """The one ds_config both zeroshard and DeepSpeed are given for ZeRO stage `stage`.

    `offload`: False / True (optimizer to CPU) / "both" (stage 3: optimizer and parameters) /
    "nvme" (optimizer states in swap files under $ZS_BENCH_NVME_PATH, default
    /work/nvme_scratch/bench; bench/nvme.md) / "nvme_both" (stage 3: parameters there too).
    """
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": spec.bucket_numel}
    if stage in (1, 2):
        # DeepSpeed's defaults for stages 1/2 except the bucket sizes; overlap_comm on so both
        # may overlap the reduction with backward (DeepSpeed's CPU accelerator has no streams).
        zero.update(allgather_bucket_size=spec.bucket_numel, overlap_comm=True,
                    contiguous_gradients=True)
    if stage == 3:
        # DeepSpeed's stage-3 defaults, except the prefetch bucket (the shared bucket size).
        zero.update(overlap_comm=True, stage3_prefetch_bucket_size=spec.bucket_numel)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload == "both":
        zero["offload_param"] = {"device": "cpu"}
    if offload in ("nvme", "nvme_both"):
        path = os.environ.get("ZS_BENCH_NVME_PATH", "/work/nvme_scratch/bench")
        os.makedirs(path, exist_ok=True)
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": path, "buffer_count": NVME_BUFFER_COUNT}
        if offload == "nvme_both":  # parameters too (stage 3): DeepSpeed's and zeroshard's defaults otherwise
            zero["offload_param"] = {"device": "nvme", "nvme_path": path}
        # sub-groups of 1M elements: with buffer_count 4 the host pool holds 4M of a rank's
        # 12.7M (stage 2/3 at world size 2), so most of the states go through the disk every step
        zero["sub_group_size"] = NVME_SUB_GROUP
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {
            "lr": spec.lr, "betas": list(spec.betas), "eps": spec.eps,
            "weight_decay": spec.weight_decay}},
        "gradient_clipping": spec.grad_clip,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_optimization": zero,
    }
    if spec.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _storage_key(t: Tensor) -> tuple[int, int] | None:
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (s.data_ptr(), s.nbytes())


def tensor_census(roots: Iterable[Any], max_depth: int = 4) -> int:
    """Bytes of distinct tensor storages reachable from `roots`.

    Walks modules (parameters, their .grad, buffers), optimizers (state, param groups) and
    plain objects' attributes, lists, tuples and dicts up to `max_depth`. A storage is counted
    once however many views point into it (flat buffers and their parameter views). DTensors
    count their local shard. This is a best-effort, engine-independent view of model-state
    memory; C++-side buffers (DDP's reducer buckets, gloo's scratch) are invisible to it.
    """
    seen_obj: set[int] = set()
    storages: dict[tuple[int, int], int] = {}

    def add(t: Tensor) -> None:
        local = getattr(t, "_local_tensor", None)  # DTensor -> its shard
        if local is not None:
            t = local
        if t.device.type == "meta":
            return
        key = _storage_key(t)
        if key is not None and key[1] > 0:
            storages[key] = key[1]

    def walk(obj: Any, depth: int) -> None:
        if obj is None or isinstance(obj, (str, bytes, int, float, bool)) or id(obj) in seen_obj:
            return
        seen_obj.add(id(obj))
        if isinstance(obj, Tensor):
            add(obj)
            if obj.grad is not None:
                add(obj.grad)
            return
        if depth <= 0:
            return
        if isinstance(obj, nn.Module):
            for p in obj.parameters():
                walk(p, depth)
            for b in obj.buffers():
                walk(b, depth)
            return
        if isinstance(obj, torch.optim.Optimizer):
            for g in obj.param_groups:
                for p in g["params"]:
                    walk(p, depth)
            for st in obj.state.values():
                walk(st, depth - 1)
            inner = getattr(obj, "optimizer", None)  # wrappers (ZeroRedundancyOptimizer, DeepSpeed)
            walk(inner, depth - 1)
            if type(obj).__module__.startswith("torch.optim"):
                return
        if isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth - 1)
            return
        if isinstance(obj, (list, tuple, set)):
            for v in obj:
                walk(v, depth - 1)
            return
        attrs = getattr(obj, "__dict__", None)
        if attrs is None:
            return
        for name, v in attrs.items():
            if name in ("module", "_modules", "timers", "monitor", "_sinks", "_progress", "comm", "_comm"):
                continue
            walk(v, depth - 1)

    for root in roots:
        walk(root, max_depth)
    return sum(storages.values())
