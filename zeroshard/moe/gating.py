"""Token routing for DeepSpeed's legacy MoE layer: top-1, top-2 and top-k gates with capacity.

Each gate turns router logits (tokens x experts, fp32) into `Routes`: for every token and route
the chosen expert, its slot in that expert's capacity buffer, and its combine weight, plus the
load-balancing loss `l_aux` and the tokens per expert. The numbers follow DeepSpeed 0.19.8's
`sharded_moe.py` (GShard / Switch): capacity ceil(tokens / experts * factor) raised to
`min_capacity`, routes past capacity dropped, random token selection (RTS) for top-1, Gumbel
sampling of the second expert for top-2. Imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

MaxOverGroup = Callable[[Tensor], Tensor]
"""All-reduce MAX of a 0-d int tensor over the expert-parallel group (capacity without dropping)."""


@dataclass(frozen=True, slots=True)
class Routes:
    """Where each token goes. `k` routes per token; a dropped route has expert -1."""

    l_aux: Tensor
    """0-d fp32 load-balancing loss (differentiable in the router logits)."""
    capacity: int
    """Slots per expert in the dispatch buffer."""
    experts: Tensor  # [k, tokens] int64, -1 = dropped
    locations: Tensor  # [k, tokens] int64, slot within the expert's buffer (0 when dropped)
    weights: Tensor  # [k, tokens] fp32 combine weights (0 when dropped)
    exp_counts: Tensor  # [experts] int64, routes chosen per expert before capacity dropping


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert: ceil(num_tokens / num_experts * capacity_factor), at least `min_capacity`."""
    # float32 arithmetic, as DeepSpeed's tensor computation, so the rounding up agrees at the edges.
    slots = torch.ceil(torch.tensor(num_tokens / num_experts) * torch.tensor(capacity_factor))
    return max(int(slots.item()), int(min_capacity))


def gumbel_noise(shape: torch.Size, device: torch.device) -> Tensor:
    """Standard Gumbel samples from the global generator (the RSample policy, top-2's second pick)."""
    zero, one = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def _dropless_capacity(exp_counts: Tensor, max_over_group: MaxOverGroup | None) -> int:
    """`drop_tokens=False`: the largest expert load on any rank of the expert-parallel group."""
    most = exp_counts.max().clone()
    if max_over_group is not None:
        most = max_over_group(most)
    return int(most.item())


def _kept_routes(experts: Tensor, mask: Tensor, locations: Tensor, weights: Tensor) -> tuple[Tensor, ...]:
    """Per-route (expert, location, weight), [k, tokens] each, from the chosen experts [tokens, k]
    and the post-capacity mask and locations [tokens, experts]."""
    kept = mask.gather(1, experts).bool()
    expert = torch.where(kept, experts, torch.full_like(experts, -1))
    location = locations.gather(1, experts) * kept
    weight = weights.gather(1, experts) * kept
    return expert.t().contiguous(), location.long().t().contiguous(), weight.t().contiguous()


def top1(logits: Tensor, capacity_factor: float, min_capacity: int, *, used_token: Tensor | None = None,
         rsample: bool = False, drop_tokens: bool = True, use_rts: bool = True,
         max_over_group: MaxOverGroup | None = None) -> Routes:
    """Switch-style routing: each token to its highest-scoring expert, up to capacity.

    With RTS the tokens an over-full expert keeps are chosen at random (a uniform draw per
    token); without it `torch.topk` over the 0/1 mask decides among equals, as in DeepSpeed.
    `rsample` (noisy_gate_policy "RSample") adds Gumbel noise to the logits for the choice only.

    Raises:
        ValueError: fewer tokens than `min_capacity`.
    """
    noisy = logits + gumbel_noise(logits.shape, logits.device) if rsample else None
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    slots = capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    choice = torch.argmax(noisy if rsample else gates, dim=1)  # [tokens]
    mask = F.one_hot(choice, num_classes=num_experts)
    if used_token is not None:
        mask = used_token.reshape(-1, 1) * mask
    exp_counts = mask.sum(dim=0).detach().long()
    if not drop_tokens:
        slots = min(_dropless_capacity(exp_counts, max_over_group), num_tokens)
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts
    scores = mask * torch.rand(mask.shape, device=mask.device) if use_rts else mask
    if num_tokens < min_capacity:
        raise ValueError(f"MoE top-1 gate: {num_tokens} tokens (batch x sequence) on this rank is fewer than "
                         f"min_capacity={min_capacity}. Set min_capacity to at most {num_tokens}, or feed more "
                         "tokens per micro-batch.")
    keep = torch.topk(scores, k=min(slots, num_tokens), dim=0)[1]  # [slots, experts] token ids
    mask = mask * torch.zeros_like(mask).scatter_(0, keep, 1)
    locations = torch.cumsum(mask, dim=0) - 1
    expert, location, weight = _kept_routes(choice.unsqueeze(1), mask, locations, gates)
    return Routes(l_aux, slots, expert, location, weight, exp_counts)


def top2(logits: Tensor, capacity_factor: float, min_capacity: int, *, drop_tokens: bool = True,
         second_expert_sampling: bool = True, max_over_group: MaxOverGroup | None = None) -> Routes:
    """GShard-style routing: the best expert, and a second one (sampled with Gumbel noise when
    `second_expert_sampling`), each route placed after every first route; the two weights are
    renormalised to sum to one over the routes kept."""
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    if second_expert_sampling:
        logits = logits + gumbel_noise(logits.shape, logits.device)
    second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach().long()
    if drop_tokens:
        slots = capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(locations1, slots)
        mask2 = mask2 * torch.lt(locations2, slots)
    else:
        slots = _dropless_capacity(exp_counts, max_over_group)
    g1 = (gates * mask1.float()).sum(dim=1)
    g2 = (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
    weights = torch.stack([g1 / denom, g2 / denom])  # [2, tokens]
    kept = torch.stack([mask1.sum(dim=1), mask2.sum(dim=1)]).bool()
    expert = torch.where(kept, torch.stack([first, second]), -1)
    location = torch.stack([(locations1 * mask1).sum(dim=1), (locations2 * mask2).sum(dim=1)])
    return Routes(l_aux, slots, expert, location.long(), weights, exp_counts)


def topk(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, *, drop_tokens: bool = True,
         max_over_group: MaxOverGroup | None = None, drop_policy: Literal["probs", "position"] = "probs") -> Routes:
    """k > 2: the k best experts per token; an over-full expert keeps the routes with the
    highest gate values (`drop_policy` "probs", what DeepSpeed's layer uses) or its first routes in
    token order ("position"); the k weights are renormalised over kept routes.

    Raises:
        ValueError: an unknown `drop_policy`.
    """
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"MoE top-k gate: drop_policy={drop_policy!r}, expected 'probs' or 'position'")
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)
    exp_counts = mask.sum(dim=0).detach().long()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts * num_experts / k
    if drop_tokens:
        slots = capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            masked = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            keep = torch.topk(masked, k=min(slots, num_tokens), dim=0, sorted=False)[1]
            mask = mask & torch.zeros_like(mask).scatter_(0, keep, True)
        else:  # the first `slots` routes of each expert in token order keep their places
            mask = mask & torch.lt(torch.cumsum(mask, dim=0) - 1, slots)
    else:
        slots = _dropless_capacity(exp_counts, max_over_group)
    locations = torch.cumsum(mask, dim=0) - 1
    masked_gates = gates * mask
    masked_gates = masked_gates / torch.clamp(masked_gates.sum(dim=-1, keepdim=True),
                                              min=torch.finfo(gates.dtype).eps)
    expert, location, weight = _kept_routes(top_idx, mask, locations, masked_gates)
    return Routes(l_aux, slots, expert, location, weight, exp_counts)


def jitter(x: Tensor, epsilon: float = 1e-2) -> Tensor:
    """The Jitter policy: multiply by uniform noise in [1 - epsilon, 1 + epsilon] (Switch Transformer)."""
    low, high = torch.tensor(1.0 - epsilon, device=x.device), torch.tensor(1.0 + epsilon, device=x.device)
    return x * torch.distributions.uniform.Uniform(low, high).rsample(x.shape)


__all__ = ["Routes", "capacity", "gumbel_noise", "jitter", "top1", "top2", "topk"]
