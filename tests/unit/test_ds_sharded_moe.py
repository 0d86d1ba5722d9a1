"""`deepspeed.moe.sharded_moe` served by the alias (zeroshard/compat/ds_sharded_moe.py): DeepSpeed's gate
functions give zeroshard's routes (moe/gating.py) in DeepSpeed's dense and sparse shapes, built here
by loops from the routes; the dropless capacity's maximum goes through the module's `dist`; the
layer's all-to-all is the module's `_AllToAll`; what is not built is refused by name. The opt-in
case compares every output, bit for bit, with a real DeepSpeed 0.19 in the same process."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from zeroshard.errors import NotSupportedError
from zeroshard.moe import gating
from zeroshard.moe.experts import _AllToAll as zeroshard_all_to_all
from zeroshard.moe.layer import MoE


def logits_for(tokens: int, experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, experts, generator=g)
    return x.round() if seed % 2 else x  # odd seeds: ties between experts


def dense_from_loops(routes: gating.Routes, experts: int) -> torch.Tensor:
    """[S, E, C] combine weights, one kept route at a time."""
    k, tokens = routes.experts.shape
    out = torch.zeros(tokens, experts, routes.capacity)
    for r in range(k):
        for s in range(tokens):
            e = int(routes.experts[r, s])
            if e >= 0:
                out[s, e, int(routes.locations[r, s])] += routes.weights[r, s]
    return out


def gate_pair(sm: Any, kind: str, logits: torch.Tensor, factor: float, drop: bool,
              sparse: bool) -> tuple[tuple, gating.Routes]:
    """DeepSpeed's gate function through the alias, and zeroshard's gate on the same generator state."""
    calls = {"top1": (lambda: sm.top1gating(logits, factor, 1, drop_tokens=drop, sparse_routes=sparse),
                      lambda: gating.top1(logits, factor, 1, drop_tokens=drop)),
             "top2": (lambda: sm.top2gating(logits, factor, 1, drop_tokens=drop, sparse_routes=sparse),
                      lambda: gating.top2(logits, factor, 1, drop_tokens=drop)),
             "top3": (lambda: sm.topkgating(logits, 3, factor, 1, drop_tokens=drop, sparse_routes=sparse),
                      lambda: gating.topk(logits, 3, factor, 1, drop_tokens=drop)),
             "top3-position": (lambda: sm.topkgating(logits, 3, factor, 1, drop_tokens=drop, drop_policy="position",
                                                     sparse_routes=sparse),
                               lambda: gating.topk(logits, 3, factor, 1, drop_tokens=drop, drop_policy="position"))}
    ds_call, zs_call = calls[kind]
    torch.manual_seed(7)
    out = ds_call()
    torch.manual_seed(7)
    return out, zs_call()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["top1", "top2", "top3", "top3-position"])
@pytest.mark.parametrize("factor, drop", [(0.5, True), (1.0, True), (2.0, True), (0.5, False)])
def test_dense_gate_output_is_zeroshards_routes(deepspeed_alias: Any, seed: int, kind: str, factor: float,
                                                drop: bool) -> None:
    import deepspeed.moe.sharded_moe as sm

    tokens, experts = 12, 4
    (l_aux, combine_weights, dispatch_mask, exp_counts), routes = gate_pair(
        sm, kind, logits_for(tokens, experts, seed), factor, drop, sparse=False)
    assert combine_weights.shape == (tokens, experts, routes.capacity)
    assert torch.equal(combine_weights, dense_from_loops(routes, experts))
    assert torch.equal(dispatch_mask, combine_weights.bool())
    assert torch.equal(l_aux, routes.l_aux) and torch.equal(exp_counts, routes.exp_counts)
    kept = int((routes.experts >= 0).sum())
    assert int(dispatch_mask.sum()) == kept and kept > 0


@pytest.mark.parametrize("kind", ["top1", "top2", "top3"])
def test_sparse_gate_output_is_zeroshards_routes(deepspeed_alias: Any, kind: str) -> None:
    import deepspeed.moe.sharded_moe as sm

    out, routes = gate_pair(sm, kind, logits_for(16, 4, 3), 0.5, True, sparse=True)
    l_aux, capacity, experts, indices, locations, gates, exp_counts = out
    assert (int(capacity), experts) == (routes.capacity, 4) and capacity.dtype == torch.int64
    assert indices.dtype == locations.dtype == torch.int32
    assert torch.equal(indices.long(), routes.experts) and torch.equal(locations.long(), routes.locations)
    assert torch.equal(gates, routes.weights) and torch.equal(exp_counts, routes.exp_counts)
    assert (indices == -1).any()  # capacity 0.5 drops routes, flagged as DeepSpeed flags them


def test_position_policy_keeps_first_routes_in_token_order(deepspeed_alias: Any) -> None:
    import deepspeed.moe.sharded_moe as sm

    logits = torch.tensor([[0.0, 2.0], [0.0, 3.0], [0.0, 4.0], [5.0, 0.0]])  # tokens 0-2 want expert 1
    # k=1, capacity ceil(4 / 2 * 0.5) = 1: "position" keeps token 0 at expert 1, "probs" the highest gate (token 2).
    _, _, position, _ = sm.topkgating(logits, 1, 0.5, 0, drop_policy="position")
    _, _, probs, _ = sm.topkgating(logits, 1, 0.5, 0, drop_policy="probs")
    assert position[:, 1, 0].tolist() == [True, False, False, False]
    assert probs[:, 1, 0].tolist() == [False, False, True, False]
    assert position[3, 0, 0] and probs[3, 0, 0]
    with pytest.raises(ValueError, match="drop_policy='first'"):
        sm.topkgating(logits, 1, 0.5, 0, drop_policy="first")


def test_sparse_encode_decode_are_the_dense_einsums(deepspeed_alias: Any) -> None:
    import deepspeed.moe.sharded_moe as sm

    torch.manual_seed(0)
    logits, hidden = torch.randn(16, 4), torch.randn(16, 8)
    _, combine_weights, dispatch_mask, _ = sm.top2gating(logits, 0.5, 0, top2_2nd_expert_sampling=False)
    _, cap, experts, idx, loc, gates, _ = sm.top2gating(logits, 0.5, 0, top2_2nd_expert_sampling=False,
                                                       sparse_routes=True)
    slots = sm._route_slots(idx, loc, experts, int(cap))
    encoded = sm._sparse_encode(hidden, slots, experts, int(cap))
    torch.testing.assert_close(encoded, torch.einsum("sec,sm->ecm", dispatch_mask.float(), hidden))
    expert_out = torch.randn_like(encoded)
    decoded = sm._sparse_decode(expert_out.view(-1, 8), slots, gates, 16)
    torch.testing.assert_close(decoded, torch.einsum("sec,ecm->sm", combine_weights, expert_out))


@pytest.mark.parametrize("gate", ["top1", "top2", "topk"])
def test_dropless_capacity_is_the_maximum_over_ep_group_through_dist(deepspeed_alias: Any,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     gate: str) -> None:
    import deepspeed.moe.sharded_moe as sm

    group, seen = object(), []

    def all_reduce(t: torch.Tensor, op: Any = None, group: Any = None) -> None:
        seen.append((op, group))
        t.fill_(11)  # another rank of the group holds 11 routes for one expert

    monkeypatch.setattr(sm.dist, "get_world_size", lambda g=None: 2 if g is group else 1)
    monkeypatch.setattr(sm.dist, "all_reduce", all_reduce)
    logits = logits_for(8, 4, 0)
    call = {"top1": lambda g: sm.top1gating(logits, 1, 0, drop_tokens=False, ep_group=g)[1],
            "top2": lambda g: sm.top2gating(logits, 1, 0, drop_tokens=False, ep_group=g)[1],
            "topk": lambda g: sm.topkgating(logits, 3, 1, 0, drop_tokens=False, ep_group=g)[1]}[gate]
    width = call(group).shape[-1]
    assert seen == [(sm.dist.ReduceOp.MAX, group)]
    assert width == (8 if gate == "top1" else 11)  # top-1 caps the capacity at the token count, as DeepSpeed
    seen.clear()
    call(None)
    call(object())  # a one-rank group: no collective
    assert seen == []


def test_moe_layer_exchanges_through_the_modules_all_to_all(deepspeed_alias: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import deepspeed.moe.sharded_moe as sm

    assert sm._AllToAll is zeroshard_all_to_all and sm.TUTEL_INSTALLED is False
    calls = []

    def counted(group: Any, x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape)
        return x

    monkeypatch.setattr(sm._AllToAll, "apply", counted)
    layer = MoE(8, nn.Linear(8, 8), num_experts=2, ep_size=2, min_capacity=0)
    layer.deepspeed_moe.set_ep_comm(SimpleNamespace(world_size=2))  # type: ignore[arg-type]
    layer(torch.randn(1, 4, 8))
    assert len(calls) == 2  # tokens out to the experts, results back
    calls.clear()
    MoE(8, nn.Linear(8, 8), num_experts=2, ep_size=1, min_capacity=0)(torch.randn(1, 4, 8))
    assert calls == []


def test_deepspeeds_gate_and_layer_classes_route_as_zeroshards(deepspeed_alias: Any) -> None:
    import deepspeed.moe.sharded_moe as sm
    from deepspeed.moe.experts import Experts

    torch.manual_seed(0)
    ours = MoE(8, nn.Linear(8, 8), num_experts=4, k=2, min_capacity=0, top2_2nd_expert_sampling=False)
    gate = sm.TopKGate(8, 4, k=2, min_capacity=0, ep_group=None, top2_2nd_expert_sampling=False)
    gate.load_state_dict(ours.deepspeed_moe.gate.state_dict())
    layer = sm.MOELayer(gate, Experts(nn.Linear(8, 8), 4), "ep_size_1", 1, 4, use_tutel=True)
    layer.experts.load_state_dict(ours.deepspeed_moe.experts.state_dict())
    x = torch.randn(2, 6, 8)
    torch.testing.assert_close(layer(x, None), ours(x)[0], rtol=0, atol=0)
    l_aux, combine_weights, _, _ = gate(x.reshape(-1, 8))
    assert torch.equal(l_aux, ours.deepspeed_moe.l_aux) and combine_weights.shape[:2] == (12, 4)
    assert layer.use_tutel is False  # Tutel asked for but not installed: DeepSpeed's warning, then without it


def test_what_is_not_built_is_refused_by_name(deepspeed_alias: Any) -> None:
    import deepspeed.moe.sharded_moe as sm

    with pytest.raises(NotSupportedError, match="top1gating.*use_tutel"):
        sm.top1gating(logits_for(8, 4, 0), 1.0, 0, use_tutel=True)
    with pytest.raises(AttributeError, match="sharded_moe.einsum.*not provided"):
        sm.einsum  # noqa: B018  the lookup itself is what is refused
    layer = sm.MOELayer(sm.TopKGate(8, 2), nn.Linear(8, 8), "ep_size_1", 1, 1)
    with pytest.raises(NotSupportedError, match="_set_ep_group"):
        layer._set_ep_group(object())


CASES = [(kind, seed, factor, drop, sparse) for kind in ("top1", "top1-rsample", "top1-used", "top2", "top2-plain",
                                                         "top3", "top3-position")
         for seed in range(3) for factor in (0.5, 2.0) for drop in (True, False) for sparse in (False, True)]


def _one_gate(sm: Any, kind: str, logits: torch.Tensor, factor: float, drop: bool, sparse: bool) -> tuple:
    kw = {"drop_tokens": drop, "sparse_routes": sparse}
    if kind == "top1":
        return sm.top1gating(logits, factor, 1, **kw)
    if kind == "top1-rsample":
        return sm.top1gating(logits, factor, 1, noisy_gate_policy="RSample", use_rts=False, **kw)
    if kind == "top1-used":
        return sm.top1gating(logits, factor, 0, used_token=(torch.arange(12) % 3 != 0).long(), **kw)
    if kind == "top2":
        return sm.top2gating(logits.clone(), factor, 1, **kw)  # DeepSpeed adds its noise to `logits` in place
    if kind == "top2-plain":
        return sm.top2gating(logits, factor, 0, top2_2nd_expert_sampling=False, **kw)
    return sm.topkgating(logits, 3, factor, 1, drop_policy="position" if kind == "top3-position" else "probs", **kw)


def _ds_outputs(sm: Any) -> dict[tuple, tuple]:
    out = {}
    for kind, seed, factor, drop, sparse in CASES:
        torch.manual_seed(100 + seed)
        out[(kind, seed, factor, drop, sparse)] = _one_gate(sm, kind, logits_for(12, 4, seed), factor, drop, sparse)
    return out


@pytest.mark.deepspeed
def test_every_output_equals_real_deepspeeds_bit_for_bit(request: pytest.FixtureRequest) -> None:
    ds = pytest.importorskip("deepspeed.moe.sharded_moe",
                             reason="compares with a real DeepSpeed 0.19, which is not installed")
    if getattr(__import__("deepspeed"), "__served_by_zeroshard__", False):
        pytest.skip("`deepspeed` is zeroshard's alias here (ZEROSHARD_AS_DEEPSPEED=1): nothing to compare with")
    theirs = _ds_outputs(ds)
    request.getfixturevalue("deepspeed_alias")
    import deepspeed.moe.sharded_moe as alias

    assert alias is not ds
    ours = _ds_outputs(alias)
    for key, want in theirs.items():
        got = ours[key]
        assert len(got) == len(want), key
        for a, b in zip(got, want):
            if torch.is_tensor(b):
                assert torch.is_tensor(a) and a.dtype == b.dtype and torch.equal(a, b), (key, a, b)
            else:
                assert int(a) == int(b), key
