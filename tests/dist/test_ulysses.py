"""DeepSpeed-Ulysses `DistributedAttention` (zeroshard/sequence/ulysses.py) at SP = world size against
one process attending over the full sequence (torch SDPA), in fp64: the output and dq/dk/dv of this
rank's sequence slice, batch-first and sequence-first, causal and not, GQA, rotary; the refusal of
head counts the group does not divide. Head counts are multiples of the world size, so every test
runs at 1-4 ranks except the refusal (nothing to refuse on one rank)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zeroshard.comm import ProcessGroups
from zeroshard.errors import NotSupportedError
from zeroshard.sequence import DistributedAttention

BATCH, LOCAL_SEQ, HEAD_DIM = 2, 3, 8
ATOL = 1e-12
"""fp64 round-off; DeepSpeed measured 0 at 2 ranks, and zeroshard matches it bit for bit so far."""


class LocalSDPA(nn.Module):
    """torch SDPA on [b, s, h, d] (batch_dim_idx 0) or [s, b, h, d] (1), GQA when k/v have fewer heads."""

    def __init__(self, batch_dim_idx: int) -> None:
        super().__init__()
        self.batch_dim_idx = batch_dim_idx

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool = False) -> Tensor:
        order = (0, 2, 1, 3) if self.batch_dim_idx == 0 else (1, 2, 0, 3)  # -> [b, h, s, d]
        back = (0, 2, 1, 3) if self.batch_dim_idx == 0 else (2, 0, 1, 3)
        q, k, v = (t.permute(order) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=q.shape[1] != k.shape[1])
        return out.permute(back)


def _rope(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The oracle's rotary embedding on the first cos.shape[-1] features (pairs i, i + rot / 2)."""
    rot = cos.shape[-1]
    x1, x2, rest = t[..., : rot // 2], t[..., rot // 2: rot], t[..., rot:]
    return torch.cat((x1 * cos[..., : rot // 2] - x2 * sin[..., : rot // 2],
                      x2 * cos[..., rot // 2:] + x1 * sin[..., rot // 2:], rest), dim=-1)


def _freqs(seq: int, rot: int, batch_dim_idx: int) -> tuple[Tensor, Tensor]:
    """(cos, sin) as DeepSpeed's forward takes them: dims 0 and 1 swapped against q's layout."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv).repeat(1, 2)  # [s, rot]
    shape = (seq, 1, 1, rot) if batch_dim_idx == 0 else (1, seq, 1, rot)
    return angles.cos().reshape(shape), angles.sin().reshape(shape)


def attention_case(attention_cls: Any, group: Any, rank: int, world_size: int, *, batch_dim_idx: int,
                   causal: bool, heads: int, kv_heads: int, rotary: bool = False) -> tuple[list[Tensor], list[Tensor]]:
    """([out, dq, dk, dv] of this rank's slice through `attention_cls`, the same from one process on
    the full sequence). Every rank draws the same full tensors; `attention_cls` is DistributedAttention
    (zeroshard's, or DeepSpeed's for the cross-check)."""
    gen = torch.Generator().manual_seed(1234)
    seq = LOCAL_SEQ * world_size
    seq_dim = 1 - batch_dim_idx

    def draw(h: int) -> Tensor:
        shape = [BATCH, seq, h, HEAD_DIM] if batch_dim_idx == 0 else [seq, BATCH, h, HEAD_DIM]
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    full = [draw(heads), draw(kv_heads), draw(kv_heads)]
    grad_out = draw(heads)
    freqs = _freqs(seq, HEAD_DIM // 2, batch_dim_idx) if rotary else None
    local = LocalSDPA(batch_dim_idx)

    # One process, whole sequence.
    leaves = [t.clone().requires_grad_() for t in full]
    q, k, v = leaves
    if freqs is not None:
        cos, sin = (f.permute(1, 0, 2, 3) for f in freqs)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    ref_out = local(q, k, v, is_causal=causal)
    ref = [ref_out.detach(), *torch.autograd.grad(ref_out, leaves, grad_out)]
    start = rank * LOCAL_SEQ
    ref = [t.narrow(seq_dim, start, LOCAL_SEQ) for t in ref]

    # This rank's slice through the sequence-parallel layer.
    shards = [t.narrow(seq_dim, start, LOCAL_SEQ).clone().requires_grad_() for t in full]
    attn = attention_cls(local, group)
    out = attn(*shards, batch_dim_idx, freqs, is_causal=causal)
    grads = torch.autograd.grad(out, shards, grad_out.narrow(seq_dim, start, LOCAL_SEQ))
    return [out.detach(), *grads], ref


def _assert_equal_to_reference(mine: list[Tensor], ref: list[Tensor]) -> None:
    for name, a, b in zip(("out", "dq", "dk", "dv"), mine, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("batch_dim_idx", [0, 1], ids=["bshd", "sbhd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv", ["mha", "gqa"])
def test_equals_full_sequence_attention(groups: ProcessGroups, batch_dim_idx: int, causal: bool, kv: str) -> None:
    p = groups.world_size
    heads, kv_heads = (2 * p, 2 * p) if kv == "mha" else (3 * p, p)  # GQA: 3 query heads per KV head
    mine, ref = attention_case(DistributedAttention, groups.dp_group, groups.rank, p,
                               batch_dim_idx=batch_dim_idx, causal=causal, heads=heads, kv_heads=kv_heads)
    _assert_equal_to_reference(mine, ref)


@pytest.mark.parametrize("batch_dim_idx", [0, 1], ids=["bshd", "sbhd"])
def test_rotary_pos_emb_applied_to_the_whole_sequence(groups: ProcessGroups, batch_dim_idx: int) -> None:
    p = groups.world_size
    mine, ref = attention_case(DistributedAttention, groups.dp_group, groups.rank, p, batch_dim_idx=batch_dim_idx,
                               causal=True, heads=2 * p, kv_heads=p, rotary=True)
    _assert_equal_to_reference(mine, ref)


@pytest.mark.parametrize("batch_dim_idx", [0, 1], ids=["bshd", "sbhd"])
def test_head_sharded_input_round_trips(groups: ProcessGroups, batch_dim_idx: int) -> None:
    """scatter_idx < 2 (DeepSpeed's other direction): the input holds h / P heads of the whole
    sequence, the local attention sees every head of a sequence slice; with an identity "attention"
    the output and the gradient are the input's."""
    p, seq_dim = groups.world_size, 1 - batch_dim_idx
    shape = [BATCH, LOCAL_SEQ * p, 2, HEAD_DIM] if batch_dim_idx == 0 else [LOCAL_SEQ * p, BATCH, 2, HEAD_DIM]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(groups.rank), dtype=torch.float64)
    x.requires_grad_()
    seen = []

    def identity(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        seen.append(q.shape)
        return q

    attn = DistributedAttention(identity, groups.dp_group, scatter_idx=seq_dim, gather_idx=2)
    out = attn(x, x, x, batch_dim_idx)
    want = list(shape)
    want[seq_dim], want[2] = LOCAL_SEQ, 2 * p
    assert list(seen[0]) == want
    torch.testing.assert_close(out, x, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    assert torch.equal(grad, torch.ones_like(x))


def test_head_count_the_group_does_not_divide_is_refused(groups: ProcessGroups) -> None:
    p = groups.world_size
    if p == 1:
        pytest.skip("every head count divides a group of one rank")
    x = torch.zeros(BATCH, LOCAL_SEQ, p + 1, HEAD_DIM, dtype=torch.float64)
    attn = DistributedAttention(LocalSDPA(0), groups.dp_group)
    sizes = ", ".join(str(d) for d in range(1, p + 2) if (p + 1) % d == 0)
    with pytest.raises(NotSupportedError, match=(
            rf"^DistributedAttention: query heads = {p + 1}, key heads = {p + 1}, value heads = {p + 1} cannot be "
            rf"split over the {p} ranks of the sequence-parallel group .* Group sizes that work here: {sizes}\. "
            r".*RingAttention")):
        attn(x, x, x, 0)
    # GQA with one KV head: the query heads divide, the KV heads do not.
    q, kv = torch.zeros(BATCH, LOCAL_SEQ, p, HEAD_DIM), torch.zeros(BATCH, LOCAL_SEQ, 1, HEAD_DIM)
    with pytest.raises(NotSupportedError, match=rf"key heads = 1, value heads = 1 cannot be split over the {p} "
                                                r"ranks.* Group sizes that work here: 1\. "):
        attn(q, kv, kv, 0)
    with pytest.raises(NotSupportedError, match=rf"^DistributedAttention: num_kv_heads = {p + 1} cannot"):
        DistributedAttention(LocalSDPA(0), groups.dp_group, num_kv_heads=p + 1)


def test_bad_layout_arguments_are_refused(groups: ProcessGroups) -> None:
    with pytest.raises(ValueError, match=r"scatter_idx=2, gather_idx=2\): one of the two must be 2"):
        DistributedAttention(LocalSDPA(0), groups.dp_group, scatter_idx=2, gather_idx=2)
    x = torch.zeros(BATCH, LOCAL_SEQ, groups.world_size, HEAD_DIM)
    with pytest.raises(ValueError, match="batch_dim_idx=2, expected 0"):
        DistributedAttention(LocalSDPA(0), groups.dp_group)(x, x, x, 2)
