"""`GatheredSplitParameters`: the whole values of AutoTP-split parameters for the length of a
`with` block (DeepSpeed's `deepspeed.module_inject.layers.GatherReplacedLayerParams`, which
OpenRLHF enters to hand whole weights to its inference engine at TP > 1).

On entry each given parameter of a `ColumnParallelLinear` (weight and bias split by rows) or a
`RowParallelLinear` (weight split by columns; its bias is whole already) is all-gathered over the
layer's tensor-parallel group and its `.data` becomes the whole tensor; on exit this rank's slice
of the (possibly modified) whole tensor is written back into the shard, which becomes `.data`
again, so an edit made inside the block on every rank persists, as in DeepSpeed. Parameters of
other layers are left alone; with none of the given parameters split the block does nothing.
A ZeRO-3 parameter must be gathered first (`zero.GatheredParameters`), as in DeepSpeed.
Imports torch, `errors` and this package's layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from zeroshard.errors import NotSupportedError
from zeroshard.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


def _split_dims(module: nn.Module) -> dict[int, tuple[Any, int]]:
    """id(parameter) -> (its layer's tensor-parallel comm, the dimension it is split along)."""
    dims: dict[int, tuple[Any, int]] = {}
    for layer in module.modules():
        if isinstance(layer, ColumnParallelLinear):
            dims[id(layer.weight)] = (layer.comm, 0)
            if layer.bias is not None:
                dims[id(layer.bias)] = (layer.comm, 0)
        elif isinstance(layer, RowParallelLinear):
            dims[id(layer.weight)] = (layer.comm, 1)
    return {k: v for k, v in dims.items() if v[0].world_size > 1}


def _gather(shard: Tensor, comm: Any, dim: int) -> Tensor:
    local = shard.detach().contiguous()
    out = torch.empty((comm.world_size, *local.shape), dtype=local.dtype, device=local.device)
    comm.all_gather(out, local)
    return torch.cat(out.unbind(0), dim=dim)


class GatheredSplitParameters:
    """Whole values of the AutoTP-split parameters among `params` inside the block (collective:
    every rank of each layer's tensor-parallel group enters with the same parameters).

    Args:
        params: a parameter or an iterable of them (e.g. `module.parameters()`).
        module: the module holding them (searched for the split layers).
        enabled: False makes the block do nothing (DeepSpeed's argument).

    Example::

        with GatheredSplitParameters([layer.weight], model):
            send(layer.weight.data)        # the whole [out, in] weight on every TP rank
    """

    def __init__(self, params: Iterable[Tensor] | Tensor, module: nn.Module, enabled: bool = True) -> None:
        params = [params] if isinstance(params, Tensor) else list(params)
        dims = _split_dims(module) if enabled else {}
        self._split = [(p, *dims[id(p)]) for p in params if id(p) in dims]
        self.enabled = bool(self._split)
        self._shards: list[Tensor] = []
        for p, _, _ in self._split:
            status = getattr(p, "ds_status", None)
            if status is not None and status.name == "NOT_AVAILABLE":
                raise NotSupportedError(
                    "GatherReplacedLayerParams: a ZeRO-3 partitioned parameter of a tensor-parallel layer; gather it "
                    "first (with zero.GatheredParameters(params): ... inside it), as DeepSpeed requires")

    def __enter__(self) -> GatheredSplitParameters:
        for p, comm, dim in self._split:
            self._shards.append(p.data)
            p.data = _gather(p.data, comm, dim)
        return self

    def __exit__(self, *exc: object) -> None:
        for (p, comm, dim), shard in zip(self._split, self._shards):
            width = shard.shape[dim]
            with torch.no_grad():
                shard.copy_(p.data.narrow(dim, comm.rank * width, width))
            p.data = shard
        self._shards.clear()
