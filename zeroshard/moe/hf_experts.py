"""AutoEP: expert parallelism for Hugging Face (transformers 5) MoE models, with no model edits.

Note: [expert banks] transformers 5 keeps each MoE layer's experts as one module (MixtralExperts,
Qwen3MoeExperts, DeepseekV3Experts, GptOssExperts, ...): parameters whose first dimension is the
expert id, and `forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`,
each token's expert outputs weighted and summed. The router runs before that call and stays the
model's own (its scores, top-k, normalisation, routed scaling, group-limited choice), so only the
bank changes here. `mark_expert_banks` swaps each bank's class for a subclass (as FSDP2's
`fully_shard` does), so module names, state-dict keys and `isinstance` stay; `shard_expert_bank`
then keeps this rank's L = E / ep experts (expert-parallel rank e holds ids e*L .. e*L+L-1,
DeepSpeed's layout, moe/ep_groups.py), on the same `Parameter` objects so an optimizer built
before `initialize` still holds them. The new forward sorts the routes by expert, sends each
expert's tokens to the rank holding it (the per-expert counts first, then the tokens, in uneven
all-to-all splits: no capacity, nothing dropped), runs the model's own expert maths there (the
bank's original forward on its local experts, each received route a top-1 route of weight 1, so
any `_experts_implementation` serves), sends the outputs back and weights and sums them per token.
Bank parameters are marked as DeepSpeed marks expert parameters (`allreduce=False`,
`group_name="ep_size_<E>"`), so the ZeRO strategy reduces them over the expert-data-parallel group
(zero/expert_split.py) and stage 3 partitions them there (Note: [experts at stage 3] in
zero/build.py). Imports torch, `zeroshard.comm`, `zeroshard.errors`, `zeroshard.config` (types)
and the moe package's own `ep_groups`.

Note: [expert banks under zero.Init] A model built or loaded inside `zero.Init` (`from_pretrained`
after a ZeRO-3 `TrainingArguments`, as Trainer users load large MoE models) holds every bank cut
into 1/N flat shards over all data-parallel ranks, not by expert. `shard_expert_bank` then gathers
one bank tensor at a time (its whole values, collective over the ranks zero.Init cut it over: every
rank walks the same banks in the same order; zero/build.py hands it zero/init_partition.py's
`take_whole`, as this package never imports zero/), keeps this rank's experts and makes the parameter a
plain one again, which stage 3 partitions over the expert-data-parallel group as it does for a
model built whole. The peak is one whole bank tensor beside the partitioned model, not the whole
model; no broadcast is needed (zero.Init's values are already rank 0's).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from zeroshard.comm import all_to_all_single
from zeroshard.errors import ConfigError, NotSupportedError
from zeroshard.moe.ep_groups import group_name
from zeroshard.moe.telemetry import in_backward

if TYPE_CHECKING:
    from zeroshard.comm import Comm
    from zeroshard.config.schema_ep import ExpertParallelConfig
    from zeroshard.moe.telemetry import RouteCounter

logger = logging.getLogger("zeroshard")


def is_expert_bank(module: nn.Module) -> bool:
    """A transformers-5 experts module (Note: [expert banks]): an int `num_experts`, its own
    parameters all indexed by expert along their first dimension, no sub-module holding any, and
    a forward of (hidden_states, top_k_index, top_k_weights): a router has the first three too."""
    count = getattr(module, "num_experts", None)
    own = list(module.parameters(recurse=False))
    if not (isinstance(count, int) and count > 0 and own and all(p.dim() >= 1 and p.shape[0] == count for p in own)):
        return False
    if any(True for c in module.children() for _ in c.parameters()):
        return False
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]  # after self
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 3


class ExpertParallelBank(nn.Module):
    """The mixin `mark_expert_banks` puts in front of a bank's class (Note: [expert banks]).

    Attributes set on the instance: `ep_size`, `expert_group_name`, `num_global_experts`, and
    after `shard_expert_bank` the expert-parallel Comm and this rank's first expert id."""

    ep_size: int
    expert_group_name: str
    num_global_experts: int
    first_expert: int
    _ep_comm: "Comm | None"
    route_counter: "RouteCounter | None" = None
    """Attached by the engine (moe/telemetry.py): this rank's routes per expert, counted per forward."""

    def set_ep_comm(self, comm: "Comm") -> None:
        self._ep_comm = comm

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        comm = self._ep_comm
        if comm is None:
            raise RuntimeError(f"expert bank {type(self).__name__} is cut over {self.ep_size} ranks but has no "
                               "expert-parallel group: zeroshard.initialize sets it up")
        tokens, k = top_k_index.shape
        local, ep = self.num_experts, self.ep_size
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # routes grouped by expert, so by destination rank
        counts = torch.bincount(flat, minlength=self.num_global_experts)  # int64
        if self.route_counter is not None and self.training and not in_backward():  # not a recompute
            self.route_counter.record_counts(counts)  # Note: [routing telemetry]
        received = torch.empty_like(counts)
        all_to_all_single(received, counts, group=comm.groups.dp_group)  # [ep, L] counts each way
        recv_counts = received.view(ep, local)
        # one read to the host for both split lists (the uneven all-to-all needs them there)
        send, recv = torch.stack([counts.view(ep, local).sum(1), recv_counts.sum(1)]).tolist()
        routed = _Exchange.apply(hidden_states[order // k], send, recv, comm)
        experts = torch.repeat_interleave(torch.arange(local, device=flat.device).repeat(ep),
                                          recv_counts.reshape(-1).to(flat.device))
        ones = torch.ones(routed.shape[0], 1, dtype=top_k_weights.dtype, device=routed.device)
        out = super().forward(routed, experts.unsqueeze(1), ones)  # the model's expert maths, weight 1
        if torch.is_grad_enabled() and not out.requires_grad:
            # No token reached this rank's experts, so the model's forward returned plain zeros; the
            # backward must still run both exchanges here, or the ranks whose tokens came here wait.
            anchor = routed if routed.requires_grad else next((p for p in self.parameters() if p.requires_grad), None)
            if anchor is not None:
                out = out + anchor.sum() * 0
        back = _Exchange.apply(out, recv, send, comm)[torch.argsort(order)]
        combined = (back.view(tokens, k, -1) * top_k_weights.unsqueeze(-1)).sum(1)
        return combined.to(hidden_states.dtype)


class _Exchange(torch.autograd.Function):
    """Rows to the expert-parallel ranks in uneven splits; the backward sends the gradients back."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, send: list[int], recv: list[int], comm: "Comm") -> Tensor:
        ctx.send, ctx.recv, ctx.comm = send, recv, comm
        out = x.new_empty((sum(recv), *x.shape[1:]))
        start = time.perf_counter()
        all_to_all_single(out, x.contiguous(), recv, send, group=comm.groups.dp_group)
        log = comm.log
        if log is not None:  # the comms logger counts the tokens moved, as its other records (input bytes)
            log.record("all_to_all", x.numel() * x.element_size(), time.perf_counter() - start, False, comm.label)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _Exchange.apply(grad.contiguous(), ctx.recv, ctx.send, ctx.comm), None, None, None


_CLASSES: dict[type, type] = {}


def _parallel_class(cls: type) -> type:
    """One expert-parallel subclass per bank class (pickling and repr name it)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelBank, cls), {})
    return _CLASSES[cls]


def expert_banks(model: nn.Module) -> list[nn.Module]:
    """The model's banks already marked for expert parallelism."""
    return [m for m in model.modules() if isinstance(m, ExpertParallelBank)]


def mark_expert_banks(model: nn.Module, ep: "ExpertParallelConfig") -> list[nn.Module]:
    """`expert_parallel.enabled`: every expert bank of `model` becomes expert-parallel over
    `ep.autoep_size` ranks (its weights are cut later, by `shard_expert_bank`). Returns the banks.

    Raises:
        ConfigError: no expert bank in the model, a `preset_model` naming another model type, or
            an `autoep_size` that does not divide a bank's experts.
    """
    if not ep.enabled:
        return []
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if ep.preset_model is not None:
        from zeroshard.config.schema_ep import PRESETS

        if model_type is not None and model_type not in PRESETS[ep.preset_model]:
            raise ConfigError(f"expert_parallel.preset_model={ep.preset_model!r} describes model type(s) "
                              f"{list(PRESETS[ep.preset_model])}, but the model is {model_type!r}: remove "
                              "preset_model (zeroshard finds the expert banks by their structure) or fix it")
    banks = [m for m in model.modules() if is_expert_bank(m) and not isinstance(m, ExpertParallelBank)]
    if not banks:
        raise ConfigError(
            f"expert_parallel.enabled: the model ({type(model).__name__}) has no transformers-5 expert bank (a "
            "module with `num_experts` whose parameters are indexed by expert, e.g. MixtralExperts). Models with "
            "one nn.Module per expert train at ZeRO-3 without expert parallelism; DeepSpeed's MoE layer "
            "(deepspeed.moe.layer.MoE) takes ep_size itself. Set expert_parallel.enabled to false")
    size = ep.autoep_size
    if size == 1:
        logger.info(f"expert_parallel: autoep_size 1, the {len(banks)} expert bank(s) stay whole on every rank")
        return []
    for bank in banks:
        if bank.num_experts % size:
            raise ConfigError(f"expert_parallel.autoep_size {size} must divide the number of experts of "
                              f"{type(bank).__name__} ({bank.num_experts})")
        bank.__class__ = _parallel_class(type(bank))
        bank.ep_size, bank.expert_group_name = size, group_name(size)
        bank.num_global_experts, bank.first_expert, bank._ep_comm = bank.num_experts, 0, None
        for p in bank.parameters(recurse=False):
            p.allreduce = False  # DeepSpeed's expert marker: reduced over the expert-data-parallel group
            p.group_name = bank.expert_group_name
        bank._register_state_dict_hook(_whole_bank_state)
    logger.info(f"expert_parallel: {len(banks)} expert bank(s) ({type(banks[0]).__mro__[2].__name__}, "
                f"{banks[0].num_global_experts} experts) cut over {size} ranks, "
                f"{banks[0].num_global_experts // size} per rank; the model's own router and expert maths")
    return banks


@torch.no_grad()
def shard_expert_bank(bank: nn.Module, ep_comm: "Comm", dp_comm: "Comm",
                      whole_of: Callable[[nn.Parameter], Tensor | None] | None = None) -> None:
    """Keep this rank's experts of a marked bank, in place; set its expert-parallel group.

    The whole bank is first broadcast from data-parallel rank 0, so the experts every rank keeps
    come from one model, as the dense parameters do (zero/stage0.py::broadcast_module_state skips
    expert parameters). Collective over the data-parallel group. `whole_of(p)`: the whole values
    of a parameter zero.Init cut (and `p` made plain), None for any other (Note: [expert banks
    under zero.Init])."""
    assert isinstance(bank, ExpertParallelBank)
    if bank.ep_size != ep_comm.world_size:
        raise NotSupportedError(f"{type(bank).__name__}: ep_size {bank.ep_size} but an expert-parallel group of "
                                f"{ep_comm.world_size} ranks")
    own = list(bank.parameters(recurse=False))
    local = bank.num_global_experts // bank.ep_size
    first = ep_comm.rank * local
    plain = []
    for p in own:  # Note: [expert banks under zero.Init]: one whole tensor at a time
        whole = whole_of(p) if whole_of is not None else None
        if whole is None:
            plain.append(p)
        else:
            p.data = whole[first:first + local].clone()
            del whole
    dp_comm.broadcast_values(plain)
    for p in plain:
        p.data = p.data[first:first + local].clone()
    bank.num_experts, bank.first_expert = local, first
    bank.set_ep_comm(ep_comm)


def gather_bank_rows(bank: nn.Module, local: Tensor) -> Tensor:
    """The whole bank tensor [E, ...] from every expert-parallel rank's rows [L, ...] (in expert
    order: rank e holds rows e*L ..). Collective over the bank's expert-parallel group."""
    comm = bank._ep_comm
    if comm is None or comm.world_size == 1:
        return local
    out = local.new_empty(comm.world_size * local.numel())
    comm.all_gather(out, local.detach().contiguous().view(-1))
    return out.view(comm.world_size * local.shape[0], *local.shape[1:])


def _whole_bank_state(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """`module.state_dict()` of a cut bank holds the whole bank (every rank's experts), so a model
    saved from it (Transformers' `Trainer.save_model`, `save_pretrained`) is the model's own. Every
    rank of the expert-parallel group must call `state_dict()` (Trainer does). With `keep_vars=True`
    (the engine's own export, which gathers itself) and for ZeRO-3 partitioned parameters the
    entries are left as they are."""
    if getattr(module, "_ep_comm", None) is None:
        return
    for name, p in module.named_parameters(recurse=False):
        value = state_dict.get(prefix + name)
        if value is None or isinstance(value, nn.Parameter) or hasattr(p, "ds_id"):
            continue
        state_dict[prefix + name] = gather_bank_rows(module, value)
