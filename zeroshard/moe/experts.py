"""Experts and token dispatch for DeepSpeed's legacy MoE layer.

`Experts` holds this rank's copies of the expert module, marked as DeepSpeed marks expert
parameters (`allreduce = False`, `group_name`). `dispatch` packs tokens into a per-expert
capacity buffer [experts, capacity, model], `exchange` moves it across the expert-parallel group
with one differentiable all-to-all, and `combine` weights each token's expert outputs back.
Imports torch, `zeroshard.moe.gating`, `zeroshard.errors` and `zeroshard.comm` (collectives go
through a `Comm`, or a process group's `all_to_all_single`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from zeroshard.comm import Comm, all_to_all_single
from zeroshard.errors import NotSupportedError
from zeroshard.moe.gating import Routes


class Experts(nn.Module):
    """`num_local_experts` deep copies of `expert`, applied to their share of the capacity buffer.

    Args:
        expert: the module each expert copies (input and output [..., hidden_size]).
        num_local_experts: experts held by this rank (num_experts / ep_size).
        expert_group_name: DeepSpeed's group name, "ep_size_<E>", set on every parameter as
            `group_name`; the engine reduces these parameters over that expert-data-parallel group.
    """

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        if any(hasattr(p, "ds_id") for p in expert.parameters()):  # a ZeRO-3 parameter, as DeepSpeed tells one
            raise NotSupportedError(
                "a MoE layer built inside zeroshard.zero.Init (deepspeed.zero.Init) is not implemented: zero.Init "
                "partitions every parameter over all data-parallel ranks, but the ranks hold different experts; "
                "build the model outside zero.Init (ZeRO stage 3 then partitions each expert over its "
                "expert-data-parallel group at initialize)")
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for module in self.deepspeed_experts:
            for param in module.parameters():
                param.allreduce = False  # type: ignore[attr-defined]  # DeepSpeed's expert marker
                param.group_name = expert_group_name  # type: ignore[attr-defined]

    def forward(self, inputs: Tensor) -> Tensor:
        """[ep_size, num_local_experts, capacity, model] -> the same shape, expert e on slice e."""
        outputs = []
        for chunk, module in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = module(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)  # (output, bias) modules: the output
        return torch.cat(outputs, dim=1)


def route_slots(routes: Routes, num_experts: int) -> Tensor:
    """[k, tokens] flat slot expert * capacity + location; dropped routes point at one spare slot
    past the end (num_experts * capacity), which dispatch fills with garbage and combine reads as 0."""
    return flat_slots(routes.experts, routes.locations, num_experts, routes.capacity)


def flat_slots(experts: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """`route_slots` from the per-route tensors ([k, tokens] expert ids, -1 = dropped, and slots)."""
    slots = experts.long() * capacity + locations.long()
    return torch.where(experts >= 0, slots, torch.full_like(slots, num_experts * capacity))


def dispatch(tokens: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """[tokens, model] -> [experts, capacity, model]: each kept route's token in its slot, empty slots 0."""
    k = slots.shape[0]
    buffer = tokens.new_zeros(num_experts * capacity + 1, tokens.shape[1])
    # Every real slot receives at most one route, so the add is a copy; the spare slot sums drops.
    buffer = buffer.index_add(0, slots.reshape(-1), tokens.repeat(k, 1))
    return buffer[:-1].view(num_experts, capacity, tokens.shape[1])


def combine(expert_out: Tensor, slots: Tensor, weights: Tensor) -> Tensor:
    """[experts * capacity, model] -> [tokens, model]: the sum over routes of weight * expert output."""
    padded = torch.cat([expert_out, expert_out.new_zeros(1, expert_out.shape[1])])
    routed = padded.index_select(0, slots.reshape(-1)).view(*slots.shape, expert_out.shape[1])
    # weights are fp32: the products and the sum over routes stay fp32, then back to the input dtype.
    return (routed * weights.unsqueeze(-1)).sum(0).to(expert_out.dtype)


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0; its gradient is the same exchange of the gradient.

    Called as DeepSpeed's `sharded_moe._AllToAll` is, `_AllToAll.apply(group, x)`, and served under
    that name by the alias: `group` is the layer's `Comm`, or a process group (from
    `deepspeed.comm.new_group`), whose exchange goes through `zeroshard.comm.all_to_all_single`.
    """

    @staticmethod
    def forward(ctx: Any, group: Any, x: Tensor) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        if isinstance(group, Comm):
            group.all_to_all(out.view(-1), x.view(-1)).wait()
        else:
            all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        return None, _AllToAll.apply(ctx.group, grad)


def exchange(x: Tensor, comm: Comm | None) -> Tensor:
    """Block r of dim 0 to rank r of the expert-parallel group; rank s's block lands at position s.
    The identity without a group (ep_size 1)."""
    if comm is None or comm.world_size == 1:
        return x.contiguous()
    return _AllToAll.apply(comm, x)
