"""DeepSpeed-Ulysses: all-to-all sequence-sharded q/k/v into head-sharded full-sequence q/k/v, run the
local attention, all-to-all back. Imports torch and `zeroshard.comm` only; never torch.distributed.

Note: [Ulysses layout]
q/k/v have their heads at dim 2: batch-first [b, s, h, d] (``batch_dim_idx=0``) or sequence-first
[s, b, h, d] (``batch_dim_idx=1``), as DeepSpeed takes them. With a group of P ranks, rank r enters
with sequence positions [r * s, (r + 1) * s) of every head; after the first all-to-all it holds heads
[r * h / P, (r + 1) * h / P) of the whole sequence (P * s positions, rank order), which is all the
local attention needs; the second all-to-all gives each rank its sequence slice of every head back.
Heads go out in contiguous blocks, so under GQA (h query heads over h_kv key/value heads) query
head i and its key/value head i // (h / h_kv) land on the same rank exactly when P divides h_kv.
A head count P does not divide is refused (DeepSpeed's uneven KV-group split is not built; a ring
for more ranks than heads is issue 41 item 3). Every rank must hold the same sequence length.
"""

from __future__ import annotations

from math import gcd
from typing import Any

import torch
from torch import Tensor, nn

from zeroshard.comm import all_to_all_single, get_world_size
from zeroshard.errors import NotSupportedError

HEAD_DIM = 2
"""Where the heads are in both layouts DeepSpeed's DistributedAttention takes."""


def _exchange(x: Tensor, group: Any, world_size: int, scatter_dim: int, gather_dim: int) -> Tensor:
    """Split ``x`` along ``scatter_dim`` into ``world_size`` blocks, send block p to rank p, and
    concatenate the blocks received along ``gather_dim``, rank 0's first."""
    # [..., P * n, ...] -> [P, ..., n, ...]: all_to_all_single sends contiguous dim-0 block p to rank p
    send = x.unflatten(scatter_dim, (world_size, -1)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    all_to_all_single(recv, send, group=group)
    # recv[p] came from rank p: put p just before gather_dim and merge the two, p-major
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    """`_exchange` with its gradient: the transpose of an all-to-all is the all-to-all the other way
    (scatter and gather dims swapped), so backward is one more exchange and is itself differentiable."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, world_size: int, scatter_dim: int, gather_dim: int) -> Tensor:
        ctx.group, ctx.world_size, ctx.dims = group, world_size, (scatter_dim, gather_dim)
        return _exchange(x, group, world_size, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _AllToAll.apply(grad, ctx.group, ctx.world_size, gather_dim, scatter_dim), None, None, None, None


def seq_all_to_all(x: Tensor, group: Any, scatter_dim: int, gather_dim: int) -> Tensor:
    """Differentiable all-to-all over ``group``: ``x`` split along ``scatter_dim`` (block p to rank p),
    the received blocks concatenated along ``gather_dim`` in rank order.

    Args:
        x: this rank's tensor; every rank passes the same shape.
        group: the process group (None: the group `zeroshard.comm`'s functions default to).
        scatter_dim: the dim to split; its size must be a multiple of the group size.
        gather_dim: the dim along which the received blocks are joined.

    Returns:
        A tensor with ``x.shape[scatter_dim] / P`` at ``scatter_dim`` and ``P * x.shape[gather_dim]``
        at ``gather_dim``; ``x`` itself on a group of one.

    Raises:
        ValueError: ``x.shape[scatter_dim]`` is not a multiple of the group size.
    """
    world_size = get_world_size(group)
    if x.shape[scatter_dim] % world_size:
        raise ValueError(f"seq_all_to_all: dim {scatter_dim} of shape {tuple(x.shape)} has size "
                         f"{x.shape[scatter_dim]}, not a multiple of the group's {world_size} ranks.")
    if world_size == 1:
        return x
    return _AllToAll.apply(x, group, world_size, scatter_dim, gather_dim)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_heads_split(counts: dict[str, int], world_size: int) -> None:
    """Refuse head counts a group of ``world_size`` ranks cannot share out whole.

    Args:
        counts: what is split, by name ("query heads", "num_kv_heads", ...) -> count.
        world_size: the sequence-parallel group size.

    Raises:
        NotSupportedError: a count is not a multiple of ``world_size``; the message names it and the
            group sizes that would work.
    """
    bad = {name: n for name, n in counts.items() if n % world_size}
    if not bad:
        return
    common = 0
    for n in counts.values():
        common = gcd(common, n)
    what = ", ".join(f"{name} = {n}" for name, n in bad.items())
    raise NotSupportedError(
        f"DistributedAttention: {what} cannot be split over the {world_size} ranks of the "
        f"sequence-parallel group (Ulysses gives every rank the same whole number of heads). "
        f"Group sizes that work here: {', '.join(map(str, _divisors(common)))}. DeepSpeed's uneven "
        f"KV-group split is not built; for more ranks than heads use zeroshard.sequence.RingAttention, or "
        f"UlyssesRingAttention (Ulysses over a group the heads divide, the ring across groups).")


def apply_rotary_pos_emb(t: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """Rotary position embedding, DeepSpeed's `deepspeed.sequence.layer.apply_rotary_pos_emb`.

    The first ``rot_dim = freqs_cos.shape[-1]`` features of ``t``'s last dim are rotated as pairs
    (i, i + rot_dim / 2): ``t * cos + rotate_half(t) * sin`` with ``rotate_half(x) = [-x2, x1]``;
    the rest pass through. ``freqs_cos`` and ``freqs_sin`` broadcast against ``t[..., :rot_dim]``.

    Raises:
        ValueError: ``rot_dim`` is odd.
    """
    rot_dim = freqs_cos.shape[-1]
    if rot_dim % 2:
        raise ValueError(f"apply_rotary_pos_emb: rotary dim {rot_dim} (freqs_cos.shape[-1]) must be even.")
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t_rot = t_rot * freqs_cos + _rotate_half(t_rot) * freqs_sin
    return t_rot if t_pass.shape[-1] == 0 else torch.cat((t_rot, t_pass), dim=-1)


def _rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] on the last dim's halves (DeepSpeed's private helper of the same name)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


_torchembed_available = False
"""DeepSpeed's flag for its optional fused rotary kernel (torchembed); zeroshard has none."""


class DistributedAttention(nn.Module):
    """DeepSpeed-Ulysses sequence-parallel attention around an unchanged local attention.

    Each rank of ``sequence_process_group`` passes its slice of the sequence (the same length on
    every rank); ``local_attention`` sees the whole sequence for 1 / P of the heads and returns them
    in the layout it got them; the output is this rank's sequence slice of every head (Note:
    [Ulysses layout]). Forward and backward equal one process attending over the full sequence.

    Args:
        local_attention: called as ``local_attention(q, k, v, *args, **kwargs)`` on the gathered
            tensors; returns the context in the same layout, heads at dim 2.
        sequence_process_group: the sequence-parallel group.
        scatter_idx: 2 (the default): the input is sequence-sharded and the first exchange scatters
            the heads. 0 or 1: the input is head-sharded over the full sequence and the first
            exchange scatters the sequence (DeepSpeed reads ``scatter_idx < 2`` the same way).
        gather_idx: the other dim of the pair: a sequence position when ``scatter_idx`` is 2, else 2.
            As in DeepSpeed, the sequence dim itself follows from ``batch_dim_idx`` in ``forward``.
        sp_stream: accepted for DeepSpeed's signature, without effect: the exchanges are not
            overlapped on a side stream (the results are the same).
        num_kv_heads: key/value heads before sharding; checked against the group at construction
            (DeepSpeed uses it to split a count the group does not divide, which zeroshard refuses).

    Raises:
        ValueError: ``scatter_idx`` / ``gather_idx`` are not one heads dim (2) and one sequence dim.
        NotSupportedError: a head count (here ``num_kv_heads``, in ``forward`` the tensors') that the
            group size does not divide; the message lists the group sizes that work.

    Example::

        >>> attn = DistributedAttention(core_attention, sp_group)           # q, k, v: [s/P, b, h, d]
        >>> out = attn(q, k, v, batch_dim_idx=1)                            # out: [s/P, b, h, d]
    """

    def __init__(self, local_attention: nn.Module, sequence_process_group: Any, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream: Any = None, num_kv_heads: int | None = None) -> None:
        super().__init__()
        if sorted((scatter_idx, gather_idx)) not in ([0, HEAD_DIM], [1, HEAD_DIM]):
            raise ValueError(
                f"DistributedAttention(scatter_idx={scatter_idx}, gather_idx={gather_idx}): one of the two must be "
                f"{HEAD_DIM} (the heads dim of [b, s, h, d] and [s, b, h, d]) and the other 0 or 1; the usual "
                "pair is the default, scatter_idx=2, gather_idx=0.")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream
        self.num_kv_heads = num_kv_heads
        if num_kv_heads is not None:
            check_heads_split({"num_kv_heads": num_kv_heads}, get_world_size(sequence_process_group))

    def layer_sync(self, layer: Any) -> None:
        """DeepSpeed's wait for an overlapped exchange; nothing to wait for here (no side stream)."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, batch_dim_idx: int, rotary_pos_emb: Any = None,
                *args: Any, **kwargs: Any) -> Tensor:
        """Attend over the whole sequence from this rank's slice.

        Args:
            query, key, value: [b, s / P, h, d] (``batch_dim_idx=0``) or [s / P, b, h, d] (1); key and
                value may have fewer heads than query (GQA) when the group size divides them.
            batch_dim_idx: 0 for batch-first, 1 for sequence-first.
            rotary_pos_emb: optional (cos, sin) over the full sequence, applied to q and k after the
                first exchange as DeepSpeed does: each 4-D, first two dims swapped, then broadcast
                against q and k, so [1, s, 1, rot_dim] fits the sequence-first layout and
                [s, 1, 1, rot_dim] the batch-first one.
            args, kwargs: passed to the local attention.

        Returns:
            The context, this rank's slice, in the input's layout.

        Raises:
            ValueError: ``batch_dim_idx`` is not 0 or 1, or a tensor has fewer than 3 dims.
            NotSupportedError: a head count the group size does not divide.
        """
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"DistributedAttention: batch_dim_idx={batch_dim_idx}, expected 0 ([b, s, h, d]) "
                             "or 1 ([s, b, h, d]).")
        if min(t.dim() for t in (query, key, value)) <= HEAD_DIM:
            raise ValueError(f"DistributedAttention: q/k/v shapes {tuple(query.shape)}, {tuple(key.shape)}, "
                             f"{tuple(value.shape)}; expected [b, s, h, d] or [s, b, h, d] (heads at dim 2).")
        world_size = get_world_size(self.spg)
        seq_dim = 1 - batch_dim_idx
        into, back = (HEAD_DIM, seq_dim), (seq_dim, HEAD_DIM)
        if self.scatter_idx != HEAD_DIM:
            into, back = back, into
        else:
            heads = {"query heads": query.shape[HEAD_DIM], "key heads": key.shape[HEAD_DIM],
                     "value heads": value.shape[HEAD_DIM]}
            check_heads_split(heads, world_size)
        q, k, v = (seq_all_to_all(t, self.spg, *into) for t in (query, key, value))
        if rotary_pos_emb is not None:
            cos, sin = (f.permute(1, 0, 2, 3) for f in rotary_pos_emb)
            q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return seq_all_to_all(context, self.spg, *back)
