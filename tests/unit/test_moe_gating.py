"""zeroshard/moe/gating.py against loop-by-token references written from DeepSpeed's description:
capacity, dropping in token order (top-2) or by random draw (RTS), by gate value (top-k), `l_aux`,
renormalised top-2/top-k weights, ties resolved to the lowest expert id."""

from __future__ import annotations

import pytest
import torch

from zeroshard.moe import gating


def logits_for(tokens: int, experts: int, seed: int, ties: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, experts, generator=g)
    return x.round() if ties else x


def as_table(routes: gating.Routes) -> dict[tuple[int, int], tuple[int, float]]:
    """(token, expert) -> (location, weight) for every kept route."""
    out = {}
    for r in range(routes.experts.shape[0]):
        for s in range(routes.experts.shape[1]):
            e = int(routes.experts[r, s])
            if e >= 0:
                out[(s, e)] = (int(routes.locations[r, s]), float(routes.weights[r, s]))
    return out


def first_max(row: list[float], skip: int = -1) -> int:
    best = None
    for i, v in enumerate(row):
        if i != skip and (best is None or v > row[best]):
            best = i
    return best  # type: ignore[return-value]


@pytest.mark.parametrize(("tokens", "experts", "factor", "minimum", "want"),
                         [(12, 4, 0.5, 0, 2), (12, 4, 1.0, 0, 3), (10, 4, 1.0, 0, 3), (12, 4, 0.5, 4, 4),
                          (7, 3, 2.0, 1, 5)])
def test_capacity(tokens: int, experts: int, factor: float, minimum: int, want: int) -> None:
    assert gating.capacity(tokens, experts, factor, minimum) == want


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_top1_rts_keeps_the_highest_draws(seed: int, factor: float) -> None:
    tokens, experts = 16, 4
    logits = logits_for(tokens, experts, seed, ties=seed % 2 == 0)
    torch.manual_seed(seed)
    routes = gating.top1(logits, factor, 1, use_rts=True)
    torch.manual_seed(seed)
    draws = torch.rand(tokens, experts)  # the gate's one draw, same generator state
    probs = torch.softmax(logits, dim=1).tolist()
    cap = gating.capacity(tokens, experts, factor, 1)
    choice = [first_max(p) for p in probs]
    want = {}
    for e in range(experts):
        mine = [s for s in range(tokens) if choice[s] == e]
        kept = sorted(sorted(mine, key=lambda s: -float(draws[s, e]))[:cap])
        for loc, s in enumerate(kept):
            want[(s, e)] = (loc, probs[s][e])
    got = as_table(routes)
    assert got.keys() == want.keys()
    for key, (loc, w) in want.items():
        assert got[key][0] == loc and got[key][1] == pytest.approx(w, rel=1e-6)
    assert routes.capacity == cap
    assert routes.exp_counts.tolist() == [choice.count(e) for e in range(experts)]
    me = [sum(p[e] for p in probs) / tokens for e in range(experts)]
    ce = [choice.count(e) / tokens for e in range(experts)]
    assert routes.l_aux.item() == pytest.approx(sum(a * b for a, b in zip(me, ce)) * experts, rel=1e-6)


def test_top1_without_rts_keeps_capacity_routes_in_token_order() -> None:
    logits = torch.zeros(12, 4)
    logits[:, 1] = 1.0  # every token wants expert 1
    routes = gating.top1(logits, 1.0, 0, use_rts=False)
    kept = [(s, loc) for (s, e), (loc, _) in as_table(routes).items()]
    assert len(kept) == 3 and sorted(loc for _, loc in kept) == [0, 1, 2]
    assert [loc for _, loc in sorted(kept)] == [0, 1, 2]  # locations follow token order
    assert routes.exp_counts.tolist() == [0, 12, 0, 0]


def test_top1_dropless_capacity_is_the_largest_load() -> None:
    logits = logits_for(20, 4, 3)
    routes = gating.top1(logits, 0.25, 0, drop_tokens=False, use_rts=False)
    assert routes.capacity == int(routes.exp_counts.max())
    assert (routes.experts >= 0).all()  # nothing dropped
    seen: list[torch.Tensor] = []
    routes = gating.top1(logits, 0.25, 0, drop_tokens=False, use_rts=False,
                         max_over_group=lambda t: seen.append(t) or torch.tensor(17))
    assert routes.capacity == 17 and len(seen) == 1


def test_top1_refuses_fewer_tokens_than_min_capacity() -> None:
    with pytest.raises(ValueError, match="min_capacity=8"):
        gating.top1(logits_for(5, 4, 0), 1.0, 8, use_rts=False)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_top2_positions_and_weights(seed: int, factor: float) -> None:
    tokens, experts = 14, 4
    logits = logits_for(tokens, experts, seed, ties=seed % 2 == 1)
    routes = gating.top2(logits, factor, 0, second_expert_sampling=False)
    probs = torch.softmax(logits, dim=1).tolist()
    rows = logits.tolist()
    cap = gating.capacity(tokens, experts, 2 * factor, 0)
    first = [first_max(p) for p in probs]
    second = [first_max(r, skip=f) for r, f in zip(rows, first)]
    fill = [0] * experts
    slot: dict[tuple[int, int], int] = {}
    for choice in (first, second):  # every first route is placed before any second route
        for s in range(tokens):
            e = choice[s]
            if fill[e] < cap:
                slot[(s, e)] = fill[e]
            fill[e] += 1
    got = as_table(routes)
    assert got.keys() == slot.keys()
    for s in range(tokens):
        kept = [e for e in (first[s], second[s]) if (s, e) in slot]
        total = sum(probs[s][e] for e in kept)
        for e in kept:
            assert got[(s, e)][0] == slot[(s, e)]
            assert got[(s, e)][1] == pytest.approx(probs[s][e] / total, rel=1e-6)
    assert routes.exp_counts.tolist() == [first.count(e) + second.count(e) for e in range(experts)]
    me = [sum(p[e] for p in probs) / tokens for e in range(experts)]
    ce = [first.count(e) / tokens for e in range(experts)]
    assert routes.l_aux.item() == pytest.approx(sum(a * b for a, b in zip(me, ce)) * experts, rel=1e-6)


def test_top2_sampling_draws_from_the_global_generator() -> None:
    logits = logits_for(32, 8, 1)
    torch.manual_seed(5)
    a = gating.top2(logits, 1.0, 0)
    torch.manual_seed(5)
    b = gating.top2(logits, 1.0, 0)
    plain = gating.top2(logits, 1.0, 0, second_expert_sampling=False)
    assert torch.equal(a.experts, b.experts)
    assert torch.equal(a.experts[0], plain.experts[0]) or (a.experts[0] < 0).any()  # the first pick is not sampled
    assert not torch.equal(a.experts[1], plain.experts[1])


@pytest.mark.parametrize("seed", range(5))
def test_topk_keeps_the_highest_gates_per_expert(seed: int) -> None:
    tokens, experts, k = 10, 5, 3
    logits = logits_for(tokens, experts, seed)
    routes = gating.topk(logits, k, 0.5, 0)
    probs = torch.softmax(logits, dim=1).tolist()
    cap = gating.capacity(tokens, experts, 0.5 * k, 0)
    chosen = [sorted(range(experts), key=lambda e: -p[e])[:k] for p in probs]
    kept = set()
    for e in range(experts):
        mine = [s for s in range(tokens) if e in chosen[s]]
        kept |= {(s, e) for s in sorted(mine, key=lambda s: -probs[s][e])[:cap]}
    got = as_table(routes)
    assert got.keys() == kept
    for e in range(experts):
        order = sorted(s for s, x in kept if x == e)
        assert [got[(s, e)][0] for s in order] == list(range(len(order)))
    for s in range(tokens):
        mine = [e for e in chosen[s] if (s, e) in kept]
        for e in mine:
            assert got[(s, e)][1] == pytest.approx(probs[s][e] / sum(probs[s][x] for x in mine), rel=1e-6)
    ce = [sum(e in c for c in chosen) / tokens for e in range(experts)]
    me = [sum(p[e] for p in probs) / tokens for e in range(experts)]
    want = sum(a * b for a, b in zip(me, ce)) / experts * experts * experts / k
    assert routes.l_aux.item() == pytest.approx(want, rel=1e-6)
