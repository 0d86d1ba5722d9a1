"""Ring attention and its 2D composition with Ulysses (zeroshard/sequence/ring.py) against one process
attending over the full sequence (torch SDPA, ``enable_gqa`` when K/V have fewer heads), in fp64: the
output and dq/dk/dv of this rank's positions, causal and not, contiguous and zigzag, GQA down to one
K/V head (what Ulysses cannot split), at every world size the run has; the 2D layout wherever its
Ulysses size divides the world; the layout helpers; the refusals. Every rank draws the same full
tensors; skips depend on the world size only."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from zeroshard.comm import ProcessGroups
from zeroshard.errors import NotSupportedError
from zeroshard.sequence.ring import (
    RingAttention,
    UlyssesRingAttention,
    ring_attention,
    shard_positions,
    shard_sequence,
    ulysses_ring_groups,
    zigzag_indices,
    zigzag_shard,
    zigzag_unshard,
)

BATCH, LOCAL_SEQ, HEAD_DIM = 2, 6, 8
ATOL = 1e-12
"""fp64 round-off: the ring merges blocks by log-sum-exp where SDPA normalises once (measured <= 4e-15 at 1-4 ranks)."""

HEADS = {"mha": (4, 4), "gqa": (4, 2), "one_kv": (3, 1)}
"""Query heads, K/V heads. one_kv: one K/V head for every rank count, which Ulysses cannot split."""


def _oracle(full: list[Tensor], grad_out: Tensor, causal: bool) -> list[Tensor]:
    """[out, dq, dk, dv] over the full sequence, [b, s, h, d], from one process."""
    leaves = [t.clone().requires_grad_() for t in full]
    q, k, v = (t.transpose(1, 2) for t in leaves)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    out = out.transpose(1, 2)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


def run_case(attend: Callable[[Tensor, Tensor, Tensor], Tensor], positions: Tensor, world_size: int, *,
             causal: bool, heads: int, kv_heads: int,
             dtype: torch.dtype = torch.float64) -> tuple[list[Tensor], list[Tensor]]:
    """([out, dq, dk, dv] at this rank's `positions` through `attend`, the same from the oracle)."""
    gen = torch.Generator().manual_seed(4321)
    seq = LOCAL_SEQ * world_size

    def draw(h: int) -> Tensor:
        return torch.randn(BATCH, seq, h, HEAD_DIM, generator=gen, dtype=torch.float64).to(dtype)

    full = [draw(heads), draw(kv_heads), draw(kv_heads)]
    grad_out = draw(heads)
    ref = [t.index_select(1, positions) for t in _oracle(full, grad_out, causal)]
    shards = [t.index_select(1, positions).requires_grad_() for t in full]
    out = attend(*shards)
    grads = torch.autograd.grad(out, shards, grad_out.index_select(1, positions))
    return [out.detach(), *grads], ref


def assert_matches(mine: list[Tensor], ref: list[Tensor], atol: float = ATOL) -> None:
    for name, a, b in zip(("out", "dq", "dk", "dv"), mine, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        assert b.abs().max() > 0.01, f"{name}: the oracle is (near) zero, the comparison would say nothing"
        torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv", list(HEADS))
def test_ring_equals_full_sequence_attention(groups: ProcessGroups, layout: str, causal: bool, kv: str) -> None:
    p = groups.world_size
    heads, kv_heads = HEADS[kv]
    positions = shard_positions(LOCAL_SEQ * p, groups.rank, p, layout=layout)
    mine, ref = run_case(lambda q, k, v: ring_attention(q, k, v, groups, causal=causal, layout=layout),
                         positions, p, causal=causal, heads=heads, kv_heads=kv_heads)
    assert_matches(mine, ref)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_module_on_the_torch_group(groups: ProcessGroups, layout: str) -> None:
    """RingAttention over the torch process group DeepSpeed scripts hold (None on one rank: comm's default)."""
    p = groups.world_size
    attn = RingAttention(groups.dp_group, causal=True, layout=layout)
    positions = shard_positions(LOCAL_SEQ * p, groups.rank, p, layout=layout)
    mine, ref = run_case(attn, positions, p, causal=True, heads=4, kv_heads=1)
    assert_matches(mine, ref)


def test_float32_accumulates_in_float32(groups: ProcessGroups) -> None:
    p = groups.world_size
    positions = shard_positions(LOCAL_SEQ * p, groups.rank, p, layout="zigzag")
    mine, ref = run_case(lambda q, k, v: ring_attention(q, k, v, groups, causal=True, layout="zigzag"),
                         positions, p, causal=True, heads=4, kv_heads=2, dtype=torch.float32)
    assert_matches(mine, ref, atol=2e-5)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("ulysses_size", [1, 2])
def test_ulysses_ring_equals_full_sequence_attention(groups: ProcessGroups, ulysses_size: int, kv_heads: int,
                                                     causal: bool, layout: str) -> None:
    p = groups.world_size
    if p % ulysses_size:
        pytest.skip(f"Ulysses size {ulysses_size} does not divide {p} ranks")
    if kv_heads % ulysses_size:
        pytest.skip("Ulysses cannot split the K/V heads (the refusal is tested below)")
    ulysses, ring = ulysses_ring_groups(groups, ulysses_size)
    assert (ulysses.world_size, ring.world_size) == (ulysses_size, p // ulysses_size)
    assert (ring.rank, ulysses.rank) == divmod(groups.rank, ulysses_size)
    attn = UlyssesRingAttention(ulysses, ring, causal=causal, layout=layout)
    positions = shard_positions(LOCAL_SEQ * p, groups.rank, p, layout=layout, ulysses_size=ulysses_size)
    mine, ref = run_case(attn, positions, p, causal=causal, heads=2 * kv_heads, kv_heads=kv_heads)
    assert_matches(mine, ref)


def test_ulysses_size_must_divide_the_heads(groups: ProcessGroups) -> None:
    if groups.world_size % 2:
        pytest.skip("needs an even number of ranks for a Ulysses size of 2")
    ulysses, ring = ulysses_ring_groups(groups, 2)
    attn = UlyssesRingAttention(ulysses, ring)
    q, kv = torch.zeros(BATCH, LOCAL_SEQ, 4, HEAD_DIM), torch.zeros(BATCH, LOCAL_SEQ, 1, HEAD_DIM)
    with pytest.raises(NotSupportedError, match=r"^UlyssesRingAttention: key/value heads = 1 cannot be split over "
                                                r"the 2 ranks of the Ulysses group .*1 is a plain ring"):
        attn(q, kv, kv)


def test_ulysses_size_must_divide_the_group(groups: ProcessGroups) -> None:
    p = groups.world_size
    with pytest.raises(ValueError, match=rf"ulysses_size {p + 1} must divide the {p} ranks"):
        ulysses_ring_groups(groups, p + 1)


def test_layout_helpers() -> None:
    assert zigzag_indices(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert zigzag_indices(4, 0, 1).tolist() == [0, 1, 2, 3]
    x = torch.arange(2 * 24 * 3, dtype=torch.float64).reshape(2, 24, 3)
    for world in (1, 2, 3, 4):
        parts = [zigzag_shard(x, r, world) for r in range(world)]
        assert all(torch.equal(a, shard_sequence(x, r, world, layout="zigzag")) for r, a in enumerate(parts))
        assert torch.equal(zigzag_unshard(parts, world), x)
        assert torch.equal(zigzag_unshard(torch.cat(parts, dim=1), world), x)
        contiguous = torch.cat([shard_positions(24, r, world) for r in range(world)])
        assert contiguous.tolist() == list(range(24))
    # 2D: contiguous is the 1D contiguous layout over all ranks; zigzag with U = 2 gives each Ulysses
    # member one chunk of its ring block.
    assert [shard_positions(16, r, 4, ulysses_size=2).tolist() for r in range(4)] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert [shard_positions(16, r, 4, layout="zigzag", ulysses_size=2).tolist() for r in range(4)] == [
        [0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_bad_inputs_are_refused(groups: ProcessGroups) -> None:
    """Each refusal is decided on this rank's own arguments, before any exchange."""
    def t(*shape: int, dtype: torch.dtype = torch.float64) -> Tensor:
        return torch.zeros(*shape, dtype=dtype)

    q, kv = t(BATCH, LOCAL_SEQ, 4, HEAD_DIM), t(BATCH, LOCAL_SEQ, 2, HEAD_DIM)
    cases = [
        ((q, kv, t(BATCH, LOCAL_SEQ, 1, HEAD_DIM)), {}, r"k and v must have the same shape"),
        ((q, t(BATCH, LOCAL_SEQ + 1, 2, HEAD_DIM), t(BATCH, LOCAL_SEQ + 1, 2, HEAD_DIM)), {},
         r"q and k/v must agree in batch, local sequence length and head dim"),
        ((q, t(BATCH, LOCAL_SEQ, 2, 4), t(BATCH, LOCAL_SEQ, 2, 4)), {}, r"must agree in batch"),
        ((t(BATCH, LOCAL_SEQ, 3, HEAD_DIM), kv, kv), {}, r"3 query heads are not a multiple of the 2 key/value"),
        ((q[0], kv[0], kv[0]), {}, r"expected 4-D \[b, s, h, d\]"),
        ((q, kv.float(), kv.float()), {}, r"expected one floating dtype"),
        ((q, kv, kv), {"layout": "ring"}, r"layout='ring', expected one of 'contiguous', 'zigzag'"),
        ((t(BATCH, 5, 4, HEAD_DIM), t(BATCH, 5, 2, HEAD_DIM), t(BATCH, 5, 2, HEAD_DIM)), {"layout": "zigzag"},
         r"layout='zigzag' with an odd local sequence length 5"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=rf"^ring_attention: .*{message}"):
            ring_attention(*args, groups, causal=True, **kwargs)
    with pytest.raises(ValueError, match=r"^RingAttention: layout='Zigzag'"):
        RingAttention(groups, layout="Zigzag")
    with pytest.raises(ValueError, match=r"sequence length 10 is not a multiple of 2 \* 2"):
        zigzag_indices(10, 0, 2)
    with pytest.raises(ValueError, match=r"3 parts for a world size of 2"):
        zigzag_unshard([q, q, q], 2)
