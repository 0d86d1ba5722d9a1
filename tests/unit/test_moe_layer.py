"""zeroshard.moe.layer.MoE in one process (ep_size 1): DeepSpeed's signature and module names, the
output against a per-token loop over the routes, eval capacity, residual MoE, and the refusals."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from zeroshard.errors import NotSupportedError
from zeroshard.moe import gating
from zeroshard.moe.layer import MoE

DEEPSPEED_SIGNATURE = (
    "(self, hidden_size: int, expert: torch.nn.modules.module.Module, num_experts: int = 1, ep_size: int = 1, "
    "k: int = 1, capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4, "
    "use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True, "
    "use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False, "
    "top2_2nd_expert_sampling: bool = True) -> None")
"""`inspect.signature(deepspeed.moe.layer.MoE.__init__)` of DeepSpeed 0.19.8."""


def expert() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 6))


def test_signature_matches_deepspeed() -> None:
    ours = inspect.signature(MoE.__init__)
    want = [p.split(":")[0].split("=")[0].strip() for p in DEEPSPEED_SIGNATURE[1:].split(") ->")[0].split(", ")]
    assert list(ours.parameters) == want
    defaults = {n: p.default for n, p in ours.parameters.items() if p.default is not inspect.Parameter.empty}
    assert defaults == dict(num_experts=1, ep_size=1, k=1, capacity_factor=1.0, eval_capacity_factor=1.0,
                            min_capacity=4, use_residual=False, noisy_gate_policy=None, drop_tokens=True,
                            use_rts=True, use_tutel=False, enable_expert_tensor_parallelism=False,
                            top2_2nd_expert_sampling=True)


def loop_reference(moe: MoE, x: torch.Tensor, routes: gating.Routes) -> torch.Tensor:
    """Each token: the sum over its kept routes of weight * expert(token)."""
    tokens = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(tokens)
    for r in range(routes.experts.shape[0]):
        for s in range(tokens.shape[0]):
            e = int(routes.experts[r, s])
            if e >= 0:
                out[s] += routes.weights[r, s] * moe.deepspeed_moe.experts.deepspeed_experts[e](tokens[s])
    return out.reshape(x.shape)


@pytest.mark.parametrize(("k", "factor"), [(1, 0.5), (1, 2.0), (2, 0.5), (2, 1.0), (3, 1.0)])
def test_output_is_the_weighted_sum_of_kept_routes(k: int, factor: float) -> None:
    torch.manual_seed(0)
    moe = MoE(6, expert(), num_experts=4, k=k, capacity_factor=factor, min_capacity=0, use_rts=False,
              top2_2nd_expert_sampling=False)
    x = torch.randn(3, 5, 6)
    out, l_aux, counts = moe(x)
    routes = moe.deepspeed_moe.gate(x.reshape(-1, 6))
    if factor < 1.0:
        assert (routes.experts < 0).any()  # some routes dropped: the output leaves them out
    torch.testing.assert_close(out, loop_reference(moe, x, routes), rtol=1e-5, atol=1e-6)
    assert torch.equal(l_aux, routes.l_aux) and torch.equal(counts, routes.exp_counts)
    out.sum().backward()  # gradients reach the router and every expert that got a token
    assert moe.deepspeed_moe.gate.wg.weight.grad is not None


def test_module_names_and_expert_marks_match_deepspeed() -> None:
    moe = MoE(6, expert(), num_experts=4, ep_size=2, use_residual=True)
    names = [n for n, _ in moe.named_parameters()]
    assert names[0] == "deepspeed_moe.gate.wg.weight"
    assert "deepspeed_moe.experts.deepspeed_experts.1.2.bias" in names and "coefficient.weight" in names
    assert "deepspeed_moe.experts.deepspeed_experts.2.0.weight" not in names  # 2 local experts of 4
    experts = [p for n, p in moe.named_parameters() if ".deepspeed_experts." in n]
    assert all(p.allreduce is False and p.group_name == "ep_size_2" for p in experts)
    assert not any(hasattr(p, "allreduce") for n, p in moe.named_parameters() if ".deepspeed_experts." not in n)
    assert (moe.num_experts, moe.num_local_experts, moe.expert_group_name) == (4, 2, "ep_size_2")


def test_eval_uses_eval_capacity_factor_and_no_noise() -> None:
    torch.manual_seed(0)
    moe = MoE(6, expert(), num_experts=4, capacity_factor=0.5, eval_capacity_factor=2.0, min_capacity=0,
              noisy_gate_policy="RSample", use_rts=False)
    x = torch.randn(24, 6)
    assert moe.deepspeed_moe.gate(x).capacity == 3
    moe.eval()
    assert moe.deepspeed_moe.gate(x).capacity == 12
    a, b = moe(x)[0], moe(x)[0]
    assert torch.equal(a, b)  # RSample noise is for training only


def test_residual_mixes_dense_and_experts_by_a_learnt_softmax() -> None:
    torch.manual_seed(0)
    moe = MoE(6, expert(), num_experts=2, use_residual=True, use_rts=False, min_capacity=0, capacity_factor=4.0)
    x = torch.randn(8, 6)
    out, _, _ = moe(x)
    experts_only = moe.deepspeed_moe(x)
    coef = torch.softmax(moe.coefficient(x), dim=-1)
    torch.testing.assert_close(out, experts_only * coef[:, :1] + moe.mlp(x) * coef[:, 1:])


def test_refusals_name_the_argument() -> None:
    with pytest.raises(NotSupportedError, match="use_tutel=True.*set use_tutel=False"):
        MoE(6, expert(), num_experts=2, use_tutel=True)
    with pytest.raises(NotSupportedError, match="enable_expert_tensor_parallelism=True.*set it to False"):
        MoE(6, expert(), num_experts=2, enable_expert_tensor_parallelism=True)
    with pytest.raises(ValueError, match="multiple of ep_size"):
        MoE(6, expert(), num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        MoE(6, expert(), num_experts=2, noisy_gate_policy="Gaussian")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="no expert-parallel group.*initialize"):
        MoE(6, expert(), num_experts=2, ep_size=2)(torch.randn(8, 6))
