"""Memory per rank with expert parallelism (AutoEP): the dense parameters under ZeRO over the
data-parallel ranks, each rank's experts under ZeRO over its expert-data-parallel group.

This is what the engine builds (zero/expert_split.py, Note: [experts at stage 3] in zero/build.py):
one strategy for the dense parameters over the `dp` ranks, one for the expert parameters over the
`dp / ep` ranks holding the same experts, each allocating as estimate/states.py models a whole
model. So `estimate_rank_ep` estimates the two shares separately and adds them category by
category: a rank holds 1 / ep of every expert bank, and ZeRO shards that over `dp / ep` ranks
instead of `dp`. Data-parallel rank r is expert-parallel rank `r % ep` and expert-data-parallel
rank `r // ep` (moe/ep_groups.py). Beside tensor or pipeline parallelism (estimate/parallel.py)
the dense share is the rank's TP / stage share and the banks are the stage's, whole on every TP
rank (AutoTP never splits an expert). Imports `zeroshard.zero.units` (the engine's stage-3 units),
`estimate.spec`, `estimate.states` and `zeroshard.moe.hf_experts` (which modules are expert banks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from torch import nn

from zeroshard.errors import ZeroshardError
from zeroshard.estimate.spec import ModelSpec, TransformerShape, spec_from_module
from zeroshard.estimate.states import RankEstimate, Setup, StateBytes, estimate_rank
from zeroshard.moe.hf_experts import is_expert_bank
from zeroshard.zero.units import default_units


@dataclass(frozen=True, kw_only=True)
class ExpertSplit:
    """A model's parameters as expert parallelism splits them.

    Attributes:
        dense: every trainable parameter but the experts' (its spec, units and all).
        banks: for each expert bank, its trainable parameters' whole sizes (every expert).
        num_experts: experts per bank (the largest, if banks differ).
        top_k: experts each token is routed to (the config's `num_experts_per_tok`, else a
            router's `top_k`; 1 when neither says).
        bank_blocks: for each bank, the block (index into `dense.unit_params[1:]`, -1: the root)
            holding it, which decides its pipeline stage; None: the banks spread evenly over the blocks.
        routers: sizes of the routers' parameters (one row per expert, beside a bank): AutoTP
            leaves them whole on every TP rank, larger than the hidden size as they are.
    """

    dense: ModelSpec
    banks: tuple[tuple[int, ...], ...]
    num_experts: int
    top_k: int = 1
    bank_blocks: tuple[int, ...] | None = None
    routers: frozenset[int] = frozenset()

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

    @property
    def tp_whole(self) -> frozenset[int]:
        """Parameter sizes AutoTP never splits: every bank's (an expert stays whole) and the routers'."""
        return self.routers | {n for bank in self.banks for n in bank}

    def blocks_of_banks(self, n_blocks: int) -> tuple[int, ...]:
        """Each bank's block among `n_blocks` (`bank_blocks`, else spread evenly in order)."""
        if self.bank_blocks is not None:
            return self.bank_blocks
        return tuple(i * n_blocks // len(self.banks) for i in range(len(self.banks)))

    def share(self, ep: int, banks: Sequence[int] | None = None) -> ModelSpec:
        """One rank's experts: 1 / ep of every bank (or of the banks numbered in `banks`: a pipeline
        stage's), one stage-3 unit per bank (the engine's)."""
        if ep < 1 or self.num_experts % ep:
            raise ZeroshardError(f"expert-parallel size {ep} must divide the {self.num_experts} experts")
        chosen = self.banks if banks is None else tuple(self.banks[i] for i in banks)
        if not chosen:
            raise ZeroshardError(f"{self.dense.name}: no expert bank chosen")
        banks_ = tuple(tuple(n // ep for n in bank) for bank in chosen)
        numels = tuple(n for bank in banks_ for n in bank)
        return ModelSpec(name=f"{self.dense.name} experts / {ep}", total_params=sum(numels),
                         largest_layer_params=max(sum(b) for b in banks_), param_numels=numels,
                         unit_params=((), *banks_), live=self.dense.live)


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
                       num_experts=max(int(b.num_experts) for b in banks), top_k=_top_k(model),
                       bank_blocks=_bank_blocks(model, banks), routers=_routers(model, banks, exclude))


def _bank_blocks(model: nn.Module, banks: list[nn.Module]) -> tuple[int, ...]:
    """The stage-3 unit (zero/units.py: the root, then each block of every ModuleList) holding each
    bank, as a block index (-1: the root): a pipeline stage holds its blocks' banks."""
    units = default_units(model)
    inside = [{id(m) for m in u.modules()} for u in units]
    return tuple(max(i for i, ids in enumerate(inside) if id(bank) in ids) - 1 for bank in banks)


def _routers(model: nn.Module, banks: list[nn.Module], experts: set[int]) -> frozenset[int]:
    """Sizes of the parameters beside each bank (in its parent module) with one row per expert: the
    routers (Mixtral's `gate`, GPT-OSS's `router`), which no Hugging Face plan splits."""
    parents = {id(b): model.get_submodule(name.rpartition(".")[0]) for name, b in model.named_modules()
               if any(b is x for x in banks)}
    return frozenset(p.numel() for b in banks for p in parents[id(b)].parameters()
                     if id(p) not in experts and p.dim() >= 1 and p.shape[0] == b.num_experts)


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


def estimate_rank_ep(split: ExpertSplit, setup: Setup, ep: int, rank: int = 0, *, dense: ModelSpec | None = None,
                     banks: Sequence[int] | None = None) -> RankEstimate:
    """Model-state bytes of data-parallel rank `rank` under `setup` (its world: the data-parallel
    ranks) with the experts cut over `ep` ranks.

    `dense`: the rank's dense parameters (its TP rank's and pipeline stage's share, estimate/parallel.py;
    default: every dense parameter); `banks`: the indices of the banks it holds a share of (its
    stage's; default: every bank). A stage without banks holds dense states only (its strategy's
    expert part is empty)."""
    dp = setup.world_size
    if ep < 1 or dp % ep:
        raise ZeroshardError(f"expert-parallel size {ep} must divide the data-parallel size {dp}")
    dense_spec = split.dense if dense is None else dense
    chosen = range(len(split.banks)) if banks is None else banks
    dense_est = estimate_rank(dense_spec, setup, rank)
    # The whole model (of the stage) is built on every rank before the banks are cut (moe/hf_experts.py).
    whole_init = 4 * (dense_spec.total_params + sum(sum(split.banks[i]) for i in chosen))
    if not chosen:
        return replace(dense_est, init_host=max(whole_init, dense_est.init_host))
    edp = replace(setup, devices_per_node=dp // ep, nodes=1)
    experts = estimate_rank(split.share(ep, chosen), edp, rank // ep)
    return replace(add(dense_est, experts), init_host=max(whole_init, dense_est.init_host))
