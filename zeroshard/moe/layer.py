"""`MoE`: DeepSpeed 0.19.8's legacy mixture-of-experts layer (`deepspeed.moe.layer.MoE`).

Same signature, module tree (`deepspeed_moe.gate.wg`, `deepspeed_moe.experts.deepspeed_experts.<i>`,
`mlp` and `coefficient` for residual MoE: state dicts load either way) and return value
`(output, l_aux, exp_counts)`. The expert-parallel group is attached by `zeroshard.initialize`
(moe/prepare.py); until then a layer with ep_size 1 runs alone and one with ep_size > 1 refuses
to run. Imports torch, `zeroshard.errors`, the moe package's own modules (telemetry.py: the gate's
route counter) and `zeroshard.comm` (for types).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

import torch.nn.functional as F
from torch import Tensor, nn

import zeroshard.moe.gating as gating
from zeroshard.errors import NotSupportedError
from zeroshard.moe.ep_groups import group_name
from zeroshard.moe.experts import Experts, combine, dispatch, exchange, route_slots
from zeroshard.moe.telemetry import RouteCounter, in_backward

if TYPE_CHECKING:
    from zeroshard.comm import Comm

logger = logging.getLogger("zeroshard")

NoisyGatePolicy = Literal["None", "Jitter", "RSample"]


class TopKGate(nn.Module):
    """The router: a bias-free linear map to expert scores (in fp32), then `moe/gating.py`'s
    top-1, top-2 or top-k routing with capacity. Train-time and eval-time capacity factors differ;
    noise (Jitter on the input, RSample on the logits) applies in training only. With a
    `route_counter` (attached by the engine, moe/telemetry.py) a training forward adds its routes
    to it, on the device (Note: [routing telemetry])."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8,
                 noisy_gate_policy: NoisyGatePolicy | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.k, self.capacity_factor, self.eval_capacity_factor = k, capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy = min_capacity, noisy_gate_policy
        self.drop_tokens, self.use_rts, self.top2_2nd_expert_sampling = drop_tokens, use_rts, top2_2nd_expert_sampling
        self.ep_comm: Comm | None = None
        self.route_counter: RouteCounter | None = None

    def _max_over_group(self, t: Tensor) -> Tensor:
        if self.ep_comm is not None and self.ep_comm.world_size > 1:
            self.ep_comm.all_reduce(t, "max")
        return t

    def forward(self, tokens: Tensor, used_token: Tensor | None = None) -> gating.Routes:
        """[tokens, model] -> Routes."""
        routes = self._route(tokens, used_token)
        if self.route_counter is not None and self.training and not in_backward():  # not a recompute
            self.route_counter.record(routes)
        return routes

    def _route(self, tokens: Tensor, used_token: Tensor | None) -> gating.Routes:
        x = tokens.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = gating.jitter(x)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return gating.top1(logits, factor, self.min_capacity, used_token=used_token,
                               rsample=self.noisy_gate_policy == "RSample" and self.training,
                               drop_tokens=self.drop_tokens, use_rts=self.use_rts, max_over_group=self._max_over_group)
        if self.k == 2:
            return gating.top2(logits, factor, self.min_capacity, drop_tokens=self.drop_tokens,
                               second_expert_sampling=self.top2_2nd_expert_sampling,
                               max_over_group=self._max_over_group)
        return gating.topk(logits, self.k, factor, self.min_capacity, drop_tokens=self.drop_tokens,
                           max_over_group=self._max_over_group)


class MOELayer(nn.Module):
    """Route, dispatch over the expert-parallel group, run the local experts, send back, combine.

    `l_aux` and `exp_counts` of the last forward are kept as attributes, as DeepSpeed keeps them.
    """

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int,
                 num_local_experts: int) -> None:
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep_group_name, self.ep_size, self.num_local_experts = ep_group_name, ep_size, num_local_experts
        self.ep_comm: Comm | None = None
        self.l_aux: Tensor | None = None
        self.exp_counts: Tensor | None = None

    def set_ep_comm(self, comm: "Comm") -> None:
        """Attach the expert-parallel group (moe/prepare.py, at initialize)."""
        if comm.world_size != self.ep_size:
            raise AssertionError(f"expected an expert-parallel group of {self.ep_size} ranks, got {comm.world_size}")
        self.ep_comm = comm
        self.gate.ep_comm = comm

    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None) -> Tensor:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])  # [S, M]
        return self.run_routes(hidden_states, self.gate(tokens, used_token))

    def run_routes(self, hidden_states: Tensor, routes: gating.Routes) -> Tensor:
        """Dispatch `hidden_states`' tokens along `routes`, run the experts, combine (the forward
        after the gate; DeepSpeed's `MOELayer` served by the alias calls it with its gate's routes)."""
        if self.ep_size > 1 and self.ep_comm is None:
            raise RuntimeError(f"MoE layer with ep_size={self.ep_size} has no expert-parallel group: pass the model "
                               "to zeroshard.initialize() (or deepspeed.initialize) before running it")
        model_dim = hidden_states.shape[-1]
        tokens = hidden_states.reshape(-1, model_dim)  # [S, M]
        num_experts = self.ep_size * self.num_local_experts
        slots = route_slots(routes, num_experts)
        buffer = dispatch(tokens, slots, num_experts, routes.capacity)  # [E, C, M]
        buffer = exchange(buffer, self.ep_comm)  # block of rank r's experts from every rank
        out = self.experts(buffer.reshape(self.ep_size, self.num_local_experts, -1, model_dim))
        out = exchange(out.reshape(num_experts, -1, model_dim), self.ep_comm)  # back to the senders
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        return combine(out.reshape(-1, model_dim), slots, routes.weights).reshape(hidden_states.shape)


class MoE(nn.Module):
    """DeepSpeed's mixture-of-experts layer: `num_experts` copies of `expert` behind a top-k router,
    split over `ep_size` expert-parallel ranks.

    The script adds `l_aux` (times its coefficient) to the loss and gives the optimizer the groups
    `split_params_into_different_moe_groups_for_optimizer` makes; `zeroshard.initialize` creates the
    expert groups and reduces expert gradients over the expert-data-parallel group (ZeRO 0-2).

    Args:
        hidden_size: input and output size of the layer (and of `expert`).
        expert: the module every expert copies (e.g. an MLP); its outputs' first element is used
            when it returns a tuple.
        num_experts: experts in the layer, across all expert-parallel ranks.
        ep_size: expert-parallel ranks; must divide `num_experts` and the data-parallel world size.
        k: routes per token (1: Switch, 2: GShard; larger k as DeepSpeed's top-k gate).
        capacity_factor: slots per expert = ceil(tokens / num_experts * capacity_factor * k) in training.
        eval_capacity_factor: the same in eval mode.
        min_capacity: at least this many slots per expert.
        use_residual: Residual MoE: mix the experts' output with a dense `expert` by a learnt softmax.
        noisy_gate_policy: None, "Jitter" (input noise) or "RSample" (Gumbel noise, top-1 only).
        drop_tokens: drop routes past capacity; False sizes the buffer to the largest load instead.
        use_rts: Random Token Selection among routes competing for a full expert (top-1).
        use_tutel: refused (Tutel's kernels are not part of zeroshard).
        enable_expert_tensor_parallelism: refused (experts split by tensor parallelism).
        top2_2nd_expert_sampling: sample top-2's second expert with Gumbel noise.

    Returns (forward):
        `(output, l_aux, exp_counts)`: output shaped as the input, the load-balancing loss (0-d),
        and the routes per expert on this rank before capacity dropping.

    Raises:
        ValueError: a bad size or policy.
        NotSupportedError: `use_tutel` or `enable_expert_tensor_parallelism`.

    Example::

        moe = MoE(hidden_size=64, expert=nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)),
                  num_experts=4, ep_size=2, k=1)
        out, l_aux, _ = moe(x)
        loss = task_loss(out) + 0.01 * l_aux
    """

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: NoisyGatePolicy | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False, top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        _check_args(num_experts, ep_size, k, noisy_gate_policy, use_tutel, enable_expert_tensor_parallelism)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = False
        self.ep_size = ep_size
        self.expert_group_name = group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        logger.info(f"MoE layer: {num_experts} experts, {self.num_local_experts} per rank, ep_size {ep_size}, k {k}")
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling)
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts  # type: ignore[return-value]


def _check_args(num_experts: int, ep_size: int, k: int, noisy_gate_policy: str | None, use_tutel: bool,
                tensor_parallel_experts: bool) -> None:
    if use_tutel:
        raise NotSupportedError("MoE(use_tutel=True): Tutel's dispatch kernels are not part of zeroshard; "
                                "set use_tutel=False (the numbers are the same, DeepSpeed falls back too "
                                "when Tutel is not installed)")
    if tensor_parallel_experts:
        raise NotSupportedError("MoE(enable_expert_tensor_parallelism=True): experts split by tensor parallelism "
                                "are not implemented; set it to False (experts are then whole on each "
                                "expert-parallel rank)")
    if ep_size < 1 or num_experts < 1 or num_experts % ep_size:
        raise ValueError(f"MoE: num_experts ({num_experts}) must be a positive multiple of ep_size ({ep_size})")
    if k < 1 or k > num_experts:
        raise ValueError(f"MoE: k={k} routes per token, expected 1 <= k <= num_experts ({num_experts})")
    if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
        raise ValueError(f"MoE: noisy_gate_policy={noisy_gate_policy!r}, expected None, 'None', 'Jitter' or "
                         "'RSample'")


__all__ = ["MOELayer", "MoE", "TopKGate"]
