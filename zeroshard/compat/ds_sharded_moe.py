"""DeepSpeed 0.19.8's `deepspeed.moe.sharded_moe` over zeroshard's MoE: its gate functions' return
values (dense `(l_aux, combine_weights, dispatch_mask, exp_counts)` or, with `sparse_routes`, the
per-route tuple) made from `moe/gating.py`'s `Routes`, and its `TopKGate` / `MOELayer` signatures
over `moe/layer.py`'s classes. The alias module `deepspeed.moe.sharded_moe` adds DeepSpeed's
module-level names (`dist`, `_AllToAll`, `TUTEL_INSTALLED`) and the collectives over `ep_group`.
Imports torch, `zeroshard.moe`, `zeroshard.comm` and `zeroshard.errors`.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
from torch import Tensor, nn

import zeroshard.comm as comm
from zeroshard.errors import NotSupportedError
from zeroshard.moe import gating, layer
from zeroshard.moe.experts import combine, dispatch, flat_slots

logger = logging.getLogger("zeroshard")

GateOutput = tuple[Tensor, ...]
"""Dense: (l_aux, combine_weights [S, E, C] fp32, dispatch_mask [S, E, C] bool, exp_counts [E]).
Sparse: (l_aux, capacity 0-d int64, num_experts, indices [k, S] int32 (-1 dropped), locations
[k, S] int32, gates [k, S] fp32, exp_counts [E])."""


def refuse_tutel(where: str) -> None:
    """DeepSpeed's gates would call Tutel's kernels; Tutel is not part of zeroshard."""
    raise NotSupportedError(f"{where}(use_tutel=True): Tutel's kernels are not part of zeroshard "
                            "(deepspeed.moe.sharded_moe.TUTEL_INSTALLED is False); pass use_tutel=False")


def gate_output(routes: gating.Routes, num_experts: int, sparse_routes: bool,
                used_token: Tensor | None = None) -> GateOutput:
    """DeepSpeed's return value of a gate function, from zeroshard's routes."""
    exp_counts = routes.exp_counts
    if used_token is not None:  # DeepSpeed counts a float `used_token` mask in its own dtype
        exp_counts = exp_counts.to(torch.promote_types(used_token.dtype, exp_counts.dtype))
    capacity = torch.tensor(routes.capacity, dtype=torch.int64, device=routes.weights.device)
    if sparse_routes:
        return (routes.l_aux, capacity, num_experts, routes.experts.to(torch.int32),
                routes.locations.to(torch.int32), routes.weights, exp_counts)
    combine_weights = dense_combine_weights(routes, num_experts)
    return routes.l_aux, combine_weights, combine_weights.bool(), exp_counts


def dense_combine_weights(routes: gating.Routes, num_experts: int) -> Tensor:
    """[S, E, C] fp32: each kept route's weight at (token, expert, slot), 0 elsewhere."""
    k, num_tokens = routes.experts.shape
    slots = flat_slots(routes.experts, routes.locations, num_experts, routes.capacity)  # [k, S]
    # One column past the end takes the dropped routes (weight 0); routes of a token never share a slot.
    out = routes.weights.new_zeros(num_tokens, num_experts * routes.capacity + 1)
    out.scatter_add_(1, slots.t(), routes.weights.t())
    return out[:, :-1].reshape(num_tokens, num_experts, routes.capacity)


def capacity(gates: Tensor, capacity_factor: Tensor, min_capacity: Tensor) -> Tensor:
    """DeepSpeed's `_capacity`: slots per expert as a 0-d int64 tensor."""
    num_tokens, num_experts = gates.shape
    return torch.tensor(gating.capacity(num_tokens, num_experts, float(capacity_factor), int(min_capacity)),
                        dtype=torch.int64, device=gates.device)


def top1(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor | None,
         noisy_gate_policy: str | None, drop_tokens: bool, use_rts: bool,
         max_over_group: gating.MaxOverGroup | None, sparse_routes: bool) -> GateOutput:
    """DeepSpeed's `top1gating` (the `ep_group` collective given as `max_over_group`)."""
    routes = gating.top1(logits, capacity_factor, min_capacity, used_token=used_token,
                         rsample=noisy_gate_policy == "RSample", drop_tokens=drop_tokens, use_rts=use_rts,
                         max_over_group=max_over_group)
    return gate_output(routes, logits.shape[1], sparse_routes, used_token)


def top2(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool,
         max_over_group: gating.MaxOverGroup | None, top2_2nd_expert_sampling: bool,
         sparse_routes: bool) -> GateOutput:
    """DeepSpeed's `top2gating`. DeepSpeed adds the second pick's Gumbel noise to the caller's
    `logits` in place; zeroshard leaves them as they were (docs/deepspeed-differences.md)."""
    routes = gating.top2(logits, capacity_factor, min_capacity, drop_tokens=drop_tokens,
                         second_expert_sampling=top2_2nd_expert_sampling, max_over_group=max_over_group)
    return gate_output(routes, logits.shape[1], sparse_routes)


def topk(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool,
         max_over_group: gating.MaxOverGroup | None, drop_policy: Literal["probs", "position"],
         sparse_routes: bool) -> GateOutput:
    """DeepSpeed's `topkgating`."""
    routes = gating.topk(logits, k, capacity_factor, min_capacity, drop_tokens=drop_tokens,
                         max_over_group=max_over_group, drop_policy=drop_policy)
    return gate_output(routes, logits.shape[1], sparse_routes)


def routes_from_sparse(output: GateOutput) -> gating.Routes:
    """The inverse of `gate_output(..., sparse_routes=True)`: what `MOELayer.run_routes` takes."""
    l_aux, slots, _, indices, locations, weights, exp_counts = output
    return gating.Routes(l_aux, int(slots), indices.long(), locations.long(), weights, exp_counts)


def sparse_encode(tokens: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """DeepSpeed's `_sparse_encode`: [S, M] -> [E, C, M] (zeroshard's `dispatch`)."""
    return dispatch(tokens, slots, num_experts, capacity)


def sparse_decode(expert_output: Tensor, slots: Tensor, gates: Tensor, num_tokens: int) -> Tensor:
    """DeepSpeed's `_sparse_decode`: [E * C, M] -> [S, M] (zeroshard's `combine`)."""
    if slots.shape[-1] != num_tokens:
        raise ValueError(f"_sparse_decode: slots hold {slots.shape[-1]} tokens, num_tokens is {num_tokens}")
    return combine(expert_output, slots, gates)


class TopKGate(layer.TopKGate):
    """DeepSpeed's `TopKGate`: its constructor (with `ep_group`) and its forward's return value
    (`GateOutput`), routing as zeroshard's gate does. Inside a zeroshard-prepared layer the
    expert-parallel `Comm` takes the dropless capacity's maximum; otherwise `ep_group` does."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group: Any = None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__(model_dim, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                         noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling)  # type: ignore[arg-type]
        self.ep_group = ep_group

    def _set_ep_group(self, ep_group: Any) -> None:
        if self.ep_group is not None:
            raise AssertionError("TopKGate._set_ep_group: the gate already has an ep_group")
        self.ep_group = ep_group

    def _max_over_group(self, t: Tensor) -> Tensor:
        if self.ep_comm is not None:
            return super()._max_over_group(t)
        if self.ep_group is not None and comm.get_world_size(self.ep_group) > 1:
            comm.all_reduce(t, op=comm.ReduceOp.MAX, group=self.ep_group)
        return t

    def forward(self, input: Tensor, used_token: Tensor | None = None,  # type: ignore[override]
                sparse_routes: bool = False, use_tutel: bool = False) -> GateOutput:
        if use_tutel:
            refuse_tutel("TopKGate.forward")
        routes = self._route(input, used_token)
        return gate_output(routes, self.wg.out_features, sparse_routes, used_token if self.k == 1 else None)


class MOELayer(layer.MOELayer):
    """DeepSpeed's `MOELayer(gate, experts, ep_group_name, ep_size, num_local_experts, use_tutel)`
    over zeroshard's: the gate may be DeepSpeed's `TopKGate` (above) or zeroshard's. As in DeepSpeed
    without Tutel installed, `use_tutel=True` logs a warning and runs without it."""

    def __init__(self, gate: nn.Module, experts: nn.Module, ep_group_name: str, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False) -> None:
        super().__init__(gate, experts, ep_group_name, ep_size, num_local_experts)  # type: ignore[arg-type]
        self.ep_group: Any = None
        self.use_tutel = False
        if use_tutel:
            logger.warning("Tutel optimization requested but not installed. Proceeding without Tutel.")

    def _set_ep_group(self, ep_group: Any) -> None:
        raise NotSupportedError(
            "MOELayer._set_ep_group: zeroshard attaches the expert-parallel group itself; build the layer as "
            "deepspeed.moe.layer.MoE(..., ep_size=N) and pass the model to deepspeed.initialize")

    def forward(self, *inputs: Tensor, **kwargs: Any) -> Tensor:  # type: ignore[override]
        hidden_states = inputs[0]
        used_token = inputs[1] if len(inputs) > 1 else None
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        if isinstance(self.gate, TopKGate):
            routes = routes_from_sparse(self.gate(tokens, used_token, True))
        else:
            routes = self.gate(tokens, used_token)
        return self.run_routes(hidden_states, routes)


def multiplicative_jitter(x: Tensor, device: torch.device, epsilon: float = 1e-2) -> Tensor:
    """DeepSpeed's `multiplicative_jitter` (zeroshard's `gating.jitter`; `device` is x's)."""
    return x if epsilon == 0 else gating.jitter(x, epsilon)


def gumbel_rsample(shape: tuple[int, ...], device: torch.device) -> Tensor:
    """DeepSpeed's `gumbel_rsample` (zeroshard's `gating.gumbel_noise`)."""
    return gating.gumbel_noise(torch.Size(shape), torch.device(device))


__all__ = ["MOELayer", "TopKGate", "capacity", "gate_output", "gumbel_rsample", "multiplicative_jitter",
           "refuse_tutel", "routes_from_sparse", "sparse_decode", "sparse_encode", "top1", "top2", "topk"]
