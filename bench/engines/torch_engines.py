"""PyTorch's own data parallelism: DDP, DDP + ZeroRedundancyOptimizer, FSDP2 (fully_shard).

The same AdamW (torch's fused CPU kernel where it accepts the parameters) and clipping as the
ZeRO engines. DDP's bucket_cap_mb is the shared bucket size in fp32 bytes; FSDP2 shards each
block and the root with reshard_after_forward=False (ZeRO-2-like: parameters stay gathered
between forward and backward).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from engines.common import RunSpec, adamw_kwargs, build_model


def _adamw(params: Iterable[Any], spec: RunSpec) -> torch.optim.Optimizer:
    params = list(params)
    try:
        return torch.optim.AdamW(params, fused=True, **adamw_kwargs(spec))
    except (RuntimeError, TypeError, ValueError):  # e.g. a tensor subclass the fused kernel refuses
        return torch.optim.AdamW(params, foreach=True, **adamw_kwargs(spec))


class TorchStepper:
    def __init__(self, spec: RunSpec, kind: str) -> None:
        if spec.precision != "fp32":
            raise NotImplementedError(f"{kind}: only fp32 is benchmarked for the torch baselines")
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        model = build_model(spec)
        self.spec = spec
        self.model = model
        if kind == "ddp":
            self.wrapped = torch.nn.parallel.DistributedDataParallel(
                model, bucket_cap_mb=spec.bucket_numel * 4 / 2**20)
            self.optimizer = _adamw(model.parameters(), spec)
        elif kind == "ddp_zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            self.wrapped = torch.nn.parallel.DistributedDataParallel(
                model, bucket_cap_mb=spec.bucket_numel * 4 / 2**20)
            self.optimizer = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, fused=True, **adamw_kwargs(spec))
        elif kind in ("fsdp2", "fsdp2_full"):
            from torch.distributed.fsdp import fully_shard

            reshard = kind == "fsdp2_full"  # full sharding: parameters freed after forward (ZeRO-3)
            for block in model.blocks:
                fully_shard(block, reshard_after_forward=reshard)
            fully_shard(model, reshard_after_forward=reshard)
            self.wrapped = model
            self.optimizer = _adamw(model.parameters(), spec)
        else:
            raise ValueError(f"unknown torch engine {kind!r}")
        inner = getattr(self.optimizer, "optim", None)  # ZeroRedundancyOptimizer's local optimizer
        fused = (inner or self.optimizer).defaults.get("fused")
        self.optimizer_name = f"{type(self.optimizer).__name__}{' (AdamW)' if inner else ''}" \
                              f"{', fused' if fused else ', foreach'}"

    def step(self, x: Tensor, y: Tensor) -> Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.wrapped(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.grad_clip)
        self.optimizer.step()
        return loss.detach()

    def census_roots(self) -> Iterable[Any]:
        return [self.model, self.optimizer]

    def reported_state_bytes(self) -> int | None:
        return None


def build(spec: RunSpec, kind: str) -> TorchStepper:
    return TorchStepper(spec, kind)
