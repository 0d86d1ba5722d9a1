"""deepspeed.moe.sharded_moe -> zeroshard.compat.ds_sharded_moe over zeroshard.moe (gates, dispatch, all-to-all).

The gate functions keep DeepSpeed 0.19.8's signatures and return values; the routing is
zeroshard's (`zeroshard/moe/gating.py`). As in DeepSpeed, the dropless capacity's maximum over
`ep_group` goes through this module's `dist` (`deepspeed.comm`), and `_AllToAll` is the autograd
function zeroshard's MoE layer exchanges its tokens with. Tutel is never installed here.
"""

from typing import Any

from torch import Tensor

from deepspeed import comm as dist
from zeroshard.compat import ds_sharded_moe as _impl
from zeroshard.moe.experts import _AllToAll, flat_slots

TUTEL_INSTALLED = False
TopKGate = _impl.TopKGate
MOELayer = _impl.MOELayer
multiplicative_jitter = _impl.multiplicative_jitter
gumbel_rsample = _impl.gumbel_rsample
_sparse_encode = _impl.sparse_encode
_sparse_decode = _impl.sparse_decode
_capacity = _impl.capacity


def _max_over(ep_group: Any) -> Any:
    """DeepSpeed's `pg_utils.is_parallel(ep_group)` guard, then MAX over the group."""
    if ep_group is None or dist.get_world_size(ep_group) <= 1:
        return None

    def max_over_group(t: Tensor) -> Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ep_group)
        return t

    return max_over_group


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor = None,
               noisy_gate_policy: str = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: Any = None, sparse_routes: bool = False, use_tutel: bool = False) -> tuple:
    if use_tutel:
        _impl.refuse_tutel("top1gating")
    return _impl.top1(logits, capacity_factor, min_capacity, used_token, noisy_gate_policy, drop_tokens, use_rts,
                      _max_over(ep_group) if not drop_tokens else None, sparse_routes)


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, top2_2nd_expert_sampling: bool = True, sparse_routes: bool = False) -> tuple:
    return _impl.top2(logits, capacity_factor, min_capacity, drop_tokens,
                      _max_over(ep_group) if not drop_tokens else None, top2_2nd_expert_sampling, sparse_routes)


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Any = None, drop_policy: str = "probs", sparse_routes: bool = False) -> tuple:
    return _impl.topk(logits, k, capacity_factor, min_capacity, drop_tokens,
                      _max_over(ep_group) if not drop_tokens else None, drop_policy, sparse_routes)  # type: ignore[arg-type]


def _route_slots(indices: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    return flat_slots(indices, locations, num_experts, int(capacity))


_NOT_BUILT = {
    "einsum": "torch.einsum", "USE_EINSUM": "torch.einsum", "_stack_routes": "the gate functions' sparse_routes=True",
    "uniform_map": "torch's global generator", "gumbel_map": "torch's global generator",
    "exp_selection_uniform_map": "torch's global generator", "TOPK_GATE_TIMER": "zeroshard's step timers",
    "MOE_TIMER": "zeroshard's step timers", "FIRST_ALLTOALL_TIMER": "zeroshard's step timers",
    "SECOND_ALLTOALL_TIMER": "zeroshard's step timers", "tutel_moe": "use_tutel=False",
}


def __getattr__(name: str) -> Any:  # a module's __getattr__ (PEP 562)
    if name in _NOT_BUILT:
        raise AttributeError(f"deepspeed.moe.sharded_moe.{name} (served by zeroshard): not provided, zeroshard's "
                             f"MoE uses {_NOT_BUILT[name]} instead; see docs/moe.md")
    raise AttributeError(f"module 'deepspeed.moe.sharded_moe' (served by zeroshard) has no attribute {name!r}")


__all__ = ["MOELayer", "TUTEL_INSTALLED", "TopKGate", "_AllToAll", "dist", "gumbel_rsample", "multiplicative_jitter",
           "top1gating", "top2gating", "topkgating"]
