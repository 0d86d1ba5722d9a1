"""Memory per rank with expert parallelism (AutoEP): the dense parameters under ZeRO over the
data-parallel ranks, each rank's experts under ZeRO over its expert-data-parallel group.

This is what the engine builds (zero/expert_split.py, Note: [experts at stage 3] in zero/build.py):
one strategy for the dense parameters over the `dp` ranks, one for the expert parameters over the
`dp / ep` ranks holding the same experts, each allocating as estimate/states.py models a whole
model. So `estimate_rank_ep` estimates the two shares separately and adds them category by
category: a rank holds 1 / ep of every expert bank, and ZeRO shards that over `dp / ep` ranks
instead of `dp`. Data-parallel rank r is expert-parallel rank `r % ep` and expert-data-parallel
rank `r // ep` (moe/ep_groups.py). Imports `estimate.spec`, `estimate.states` and
`zeroshard.moe.hf_experts` (which modules are expert banks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from zeroshard.errors import ZeroshardError
from zeroshard.estimate.spec import ModelSpec, TransformerShape, spec_from_module
from zeroshard.estimate.states import RankEstimate, Setup, StateBytes, estimate_rank
from zeroshard.moe.hf_experts import is_expert_bank


@dataclass(frozen=True, kw_only=True)
class ExpertSplit:
    """A model's parameters as expert parallelism splits them.

    Attributes:
        dense: every trainable parameter but the experts' (its spec, units and all).
        banks: for each expert bank, its trainable parameters' whole sizes (every expert).
        num_experts: experts per bank (the largest, if banks differ).
        top_k: experts each token is routed to (the config's `num_experts_per_tok`, else a
            router's `top_k`; 1 when neither says).
    """

    dense: ModelSpec
    banks: tuple[tuple[int, ...], ...]
    num_experts: int
    top_k: int = 1

    @property
    def expert_params(self) -> int:
        return sum(sum(b) for b in self.banks)

    @property
    def moe_layers(self) -> int:
        """Expert banks, one per MoE layer: each dispatches and combines its tokens once per pass."""
        return len(self.banks)

    @property
    def active_params(self) -> int:
        """Parameters one token goes through: the dense ones and top_k of each bank's experts."""
        return self.dense.total_params + self.expert_params * min(self.top_k, self.num_experts) // self.num_experts

    def share(self, ep: int) -> ModelSpec:
        """One rank's experts: 1 / ep of every bank, one stage-3 unit per bank (the engine's)."""
        if ep < 1 or self.num_experts % ep:
            raise ZeroshardError(f"expert-parallel size {ep} must divide the {self.num_experts} experts")
        banks = tuple(tuple(n // ep for n in bank) for bank in self.banks)
        numels = tuple(n for bank in banks for n in bank)
        return ModelSpec(name=f"{self.dense.name} experts / {ep}", total_params=sum(numels),
                         largest_layer_params=max(sum(b) for b in banks), param_numels=numels,
                         unit_params=((), *banks), live=self.dense.live)


def split_experts(model: nn.Module, name: str | None = None,
                  shape: TransformerShape | None = None) -> ExpertSplit | None:
    """The expert split of a live (or meta-device) Hugging Face MoE model; None without expert banks."""
    banks = [m for m in model.modules() if is_expert_bank(m)]
    if not banks:
        return None
    bank_params = [[p for p in b.parameters(recurse=False) if p.requires_grad] for b in banks]
    exclude = {id(p) for params in bank_params for p in params}
    dense = spec_from_module(model, name=name, shape=shape, exclude=exclude)
    return ExpertSplit(dense=dense, banks=tuple(tuple(p.numel() for p in params) for params in bank_params),
                       num_experts=max(int(b.num_experts) for b in banks), top_k=_top_k(model))


def _top_k(model: nn.Module) -> int:
    """Experts per token: the Hugging Face config's `num_experts_per_tok` (Mixtral, Qwen-MoE,
    DeepSeek, GPT-OSS), else the first module with an integer `top_k` (a router), else 1."""
    k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    if isinstance(k, int) and k >= 1:
        return k
    for m in model.modules():
        k = getattr(m, "top_k", None)
        if isinstance(k, int) and not isinstance(k, bool) and k >= 1:
            return k
    return 1


def add(a: RankEstimate, b: RankEstimate) -> RankEstimate:
    """Two strategies' holdings on one rank, category by category (the model is built once)."""
    def both(x: StateBytes, y: StateBytes) -> StateBytes:
        return StateBytes(x.params + y.params, x.grads + y.grads, x.master_params + y.master_params,
                          x.optimizer_states + y.optimizer_states)

    return RankEstimate(both(a.device, b.device), both(a.host, b.host), both(a.nvme, b.nvme),
                        a.device_buffers + b.device_buffers, a.host_buffers + b.host_buffers,
                        a.init_host + b.init_host, a.staging_pool + b.staging_pool)


def estimate_rank_ep(split: ExpertSplit, setup: Setup, ep: int, rank: int = 0) -> RankEstimate:
    """Model-state bytes of data-parallel rank `rank` under `setup` (its world: the data-parallel
    ranks) with the experts cut over `ep` ranks."""
    dp = setup.world_size
    if ep < 1 or dp % ep:
        raise ZeroshardError(f"expert-parallel size {ep} must divide the data-parallel size {dp}")
    dense = estimate_rank(split.dense, setup, rank)
    edp = replace(setup, devices_per_node=dp // ep, nodes=1)
    experts = estimate_rank(split.share(ep), edp, rank // ep)
    # The whole model is built on every rank before the banks are cut (moe/hf_experts.py).
    whole_init = 4 * (split.dense.total_params + split.expert_params)
    return replace(add(dense, experts), init_host=max(whole_init, dense.init_host))
