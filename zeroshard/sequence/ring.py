"""Ring (context-parallel) attention: each rank keeps its query slice while the key/value slices travel
around the group, the partial outputs merged exactly by log-sum-exp; and its 2D composition with
DeepSpeed-Ulysses (heads all-to-all inside small groups, the ring across them). Imports torch,
`zeroshard.comm` and `sequence/ulysses.py` only; never torch.distributed (the exchanges go through comm/).

Note: [ring layout]
q/k/v are batch-first [b, s, h, d] (DeepSpeed's ``batch_dim_idx=0``), every rank holding s positions of
a sequence of P * s, in one of two layouts over the P ranks of the ring group (ranks in group order):
- ``"contiguous"``: rank r holds positions [r * s, (r + 1) * s).
- ``"zigzag"``: the sequence is cut into 2P chunks of s / 2 and rank r holds chunks r and 2P - 1 - r,
  in that order. Under a causal mask every rank then does the same work, 2P - 1 chunk-sized squares
  and two triangles, where contiguously rank r does r blocks of s x s and one triangle.
`shard_positions` returns the global positions a rank holds (`zigzag_shard` / `zigzag_unshard` lay
data out and back). Without a causal mask the layout changes nothing but which positions a rank holds.

Note: [ring exchange]
zeroshard.comm has no point-to-point send/recv, so one ring step is an `all_to_all_single` with
uneven splits: the whole buffer goes to rank r + 1, all of rank r - 1's buffer is received, every
other split is empty. It is issued asynchronously before the step's arithmetic and waited after it,
so the transfer overlaps the compute, and a rank holds at most two K/V blocks at once (the one in use
and the one arriving), never all P. Forward: P - 1 exchanges of the stacked (k, v) block. Backward
(hand-written, flash-attention style, see `_RingAttention`): the (k, v) blocks travel again (P - 1
exchanges), and the gradient of each block travels with it one step behind (P exchanges, the last
brings every block's dk / dv home), each overlapped with the next step's arithmetic.

Note: [2D layout]
`UlyssesRingAttention` runs on an SP group of P = U x R ranks split by `ulysses_ring_groups`: SP rank
p = i * U + j is member j of Ulysses group i (U consecutive ranks) and member i of ring group j (ranks
j, j + U, ...). The Ulysses all-to-all joins the U sequence slices of group i, member 0's first, into
ring block i for H / U of the heads; the ring then runs over the R ranks holding those heads. So ring
block i is what ring rank i holds in the R-rank layout over the whole sequence, and SP rank (i, j)
holds the j-th of its U equal consecutive pieces: contiguously, SP rank p holds [p * s, (p + 1) * s)
(the 1D contiguous layout over all P ranks); zigzag with U = 2, rank (i, 0) holds chunk i of 2R and
rank (i, 1) chunk 2R - 1 - i. ``shard_positions(..., ulysses_size=U)`` gives them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from zeroshard.comm import ProcessGroups, all_to_all_single, get_rank, get_world_size
from zeroshard.comm.groups import subgroup
from zeroshard.errors import NotSupportedError
from zeroshard.sequence.ulysses import seq_all_to_all

LAYOUTS = ("contiguous", "zigzag")
"""The sequence layouts over a ring's ranks (Note: [ring layout])."""

SEQ_DIM, HEAD_DIM = 1, 2
"""Where the sequence and the heads are in the [b, s, h, d] tensors the ring takes."""


# ---------------------------------------------------------------------------------------------------
# Layouts


def _check_layout(layout: str, where: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: layout={layout!r}, expected one of {', '.join(map(repr, LAYOUTS))}.")


def zigzag_indices(seq_len: int, rank: int, world_size: int) -> Tensor:
    """The global positions rank ``rank`` holds in the zigzag layout (Note: [ring layout]).

    Args:
        seq_len: the whole sequence's length; a multiple of ``2 * world_size``.
        rank: the rank's position in the ring group.
        world_size: the ring group's size.

    Returns:
        An int64 tensor of ``seq_len / world_size`` positions: chunk ``rank`` then chunk
        ``2 * world_size - 1 - rank`` of the ``2 * world_size`` chunks.

    Raises:
        ValueError: ``seq_len`` is not a multiple of ``2 * world_size``, or ``rank`` is out of range.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"zigzag_indices: rank {rank} of world size {world_size} is out of range.")
    if seq_len % (2 * world_size):
        raise ValueError(f"zigzag_indices: sequence length {seq_len} is not a multiple of 2 * {world_size} "
                         f"(the zigzag layout cuts it into {2 * world_size} equal chunks).")
    chunk = seq_len // (2 * world_size)
    first, second = rank * chunk, (2 * world_size - 1 - rank) * chunk
    return torch.cat((torch.arange(first, first + chunk), torch.arange(second, second + chunk)))


def shard_positions(seq_len: int, rank: int, world_size: int, *, layout: str = "contiguous",
                    ulysses_size: int = 1) -> Tensor:
    """The global positions SP rank ``rank`` holds, in its local order (Notes: [ring layout], [2D layout]).

    Args:
        seq_len: the whole sequence's length.
        rank: the rank's position in the group (the SP group under 2D).
        world_size: the group's size, ``ulysses_size`` x the ring's size.
        layout: "contiguous" or "zigzag", the ring's layout.
        ulysses_size: U of the 2D layout; 1 for a plain ring over the whole group.

    Returns:
        An int64 tensor of ``seq_len / world_size`` positions.

    Raises:
        ValueError: an unknown layout, ``ulysses_size`` not dividing ``world_size``, or a length the
            layout cannot cut evenly.
    """
    _check_layout(layout, "shard_positions")
    if ulysses_size < 1 or world_size % ulysses_size or not 0 <= rank < world_size:
        raise ValueError(f"shard_positions: rank {rank} of {world_size} with ulysses_size {ulysses_size}: "
                         "expected 0 <= rank < world_size and ulysses_size dividing world_size.")
    ring_size, (ring_rank, member) = world_size // ulysses_size, divmod(rank, ulysses_size)
    if seq_len % world_size:
        raise ValueError(f"shard_positions: sequence length {seq_len} is not a multiple of the {world_size} ranks.")
    if layout == "zigzag":
        block = zigzag_indices(seq_len, ring_rank, ring_size)
    else:
        size = seq_len // ring_size
        block = torch.arange(ring_rank * size, (ring_rank + 1) * size)
    piece = seq_len // world_size
    return block[member * piece:(member + 1) * piece]


def shard_sequence(x: Tensor, rank: int, world_size: int, *, layout: str = "contiguous", ulysses_size: int = 1,
                   seq_dim: int = SEQ_DIM) -> Tensor:
    """This rank's slice of a whole-sequence tensor: ``x`` at `shard_positions` along ``seq_dim``.

    Raises:
        ValueError: as `shard_positions`.
    """
    positions = shard_positions(x.shape[seq_dim], rank, world_size, layout=layout, ulysses_size=ulysses_size)
    return x.index_select(seq_dim, positions.to(x.device))


def zigzag_shard(x: Tensor, rank: int, world_size: int, seq_dim: int = SEQ_DIM) -> Tensor:
    """Rank ``rank``'s zigzag slice of a whole-sequence tensor (chunks rank and 2P - 1 - rank).

    Raises:
        ValueError: as `zigzag_indices`.
    """
    return x.index_select(seq_dim, zigzag_indices(x.shape[seq_dim], rank, world_size).to(x.device))


def zigzag_unshard(parts: Tensor | list[Tensor] | tuple[Tensor, ...], world_size: int,
                   seq_dim: int = SEQ_DIM) -> Tensor:
    """The whole sequence in global order from the ranks' zigzag slices.

    Args:
        parts: the ``world_size`` slices in rank order, or their concatenation along ``seq_dim``
            (what an all-gather returns).
        world_size: the ring group's size.
        seq_dim: the sequence dim.

    Returns:
        The whole-sequence tensor; differentiable (an index_select).

    Raises:
        ValueError: a list of the wrong length, or a length the layout cannot cut evenly.
    """
    if isinstance(parts, (list, tuple)):
        if len(parts) != world_size:
            raise ValueError(f"zigzag_unshard: {len(parts)} parts for a world size of {world_size}.")
        parts = torch.cat(list(parts), dim=seq_dim)
    seq_len = parts.shape[seq_dim]
    held = torch.cat([zigzag_indices(seq_len, r, world_size) for r in range(world_size)])
    return parts.index_select(seq_dim, torch.argsort(held).to(parts.device))


def _chunks(layout: str, holder: int, world_size: int, s: int) -> list[tuple[int, int, int]]:
    """(global chunk index, local start, length) of what ring rank ``holder`` holds; chunk indices are
    comparable within one layout (Note: [ring layout])."""
    if layout == "contiguous":
        return [(holder, 0, s)]
    half = s // 2
    return [(holder, 0, half), (2 * world_size - 1 - holder, half, half)]


def _tiles(layout: str, causal: bool, rank: int, src: int, world_size: int,
           s: int) -> list[tuple[slice, slice, bool]]:
    """The (query rows, key rows, diagonal) blocks rank ``rank`` computes against ``src``'s K/V block.

    Without a causal mask: the whole block. With one: each pair of chunks is fully visible (the query
    chunk comes later), diagonal (the same chunk: triangular mask) or skipped (earlier); fully visible
    neighbours are merged into one rectangle (zigzag: all queries x the first K/V half when src < rank,
    the second query half x all of K/V when src > rank).
    """
    if not causal:
        return [(slice(0, s), slice(0, s), False)]
    cells = []
    for q_chunk, q0, q_len in _chunks(layout, rank, world_size, s):
        for k_chunk, k0, k_len in _chunks(layout, src, world_size, s):
            if k_chunk <= q_chunk:
                cells.append((q0, q_len, k0, k_len, k_chunk == q_chunk))
    merged = True
    while merged:
        merged = False
        for a in cells:
            for b in cells:
                if a is b or a[4] or b[4]:
                    continue
                if a[:2] == b[:2] and a[2] + a[3] == b[2]:
                    new = (a[0], a[1], a[2], a[3] + b[3], False)
                elif a[2:4] == b[2:4] and a[0] + a[1] == b[0]:
                    new = (a[0], a[1] + b[1], a[2], a[3], False)
                else:
                    continue
                cells = [c for c in cells if c is not a and c is not b] + [new]
                merged = True
                break
            if merged:
                break
    return [(slice(q0, q0 + q_len), slice(k0, k0 + k_len), diag) for q0, q_len, k0, k_len, diag in cells]


# ---------------------------------------------------------------------------------------------------
# The ring exchange


def _group_info(group: Any) -> tuple[Any, int, int]:
    """(the torch group to pass to comm's functions, this rank's position, the group's size)."""
    if isinstance(group, ProcessGroups):
        return group.dp_group, group.rank, group.world_size
    return group, get_rank(group), get_world_size(group)


class _Pending:
    """One ring step in flight; ``wait`` returns the previous rank's tensor."""

    __slots__ = ("_work", "_send", "_recv")

    def __init__(self, work: Any, send: Tensor, recv: Tensor) -> None:
        self._work, self._send, self._recv = work, send, recv  # the send buffer lives until the wait

    def wait(self) -> Tensor:
        self._work.wait()
        self._send = None
        return self._recv


def _ring_send(x: Tensor, group: Any, rank: int, world_size: int) -> _Pending:
    """Send ``x`` to ring rank ``rank + 1`` and receive rank ``rank - 1``'s tensor of the same shape and
    dtype, asynchronously (Note: [ring exchange])."""
    send = x.contiguous().view(-1)
    recv = torch.empty_like(send)
    into, out_of = [0] * world_size, [0] * world_size
    into[(rank + 1) % world_size] = send.numel()
    out_of[(rank - 1) % world_size] = send.numel()
    work = all_to_all_single(recv, send, out_of, into, group=group, async_op=True)
    return _Pending(work, send, recv.view(x.shape))


# ---------------------------------------------------------------------------------------------------
# Block arithmetic. Inside the ring: q is [b, h_kv, g, s, d] (g query heads share one K/V head),
# k / v / (k, v) stacks are [b, h_kv, s, d]; the softmax statistics and the accumulators are in the
# accumulation dtype (fp64 for fp64 inputs, else fp32).


def _scores(q: Tensor, k: Tensor, scale: float, diag: bool) -> Tensor:
    s = torch.einsum("bhgqd,bhkd->bhgqk", q, k).mul_(scale)
    if diag:  # the same chunk on both sides: key i is visible to query j exactly when i <= j
        n = s.shape[-1]
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    return s


def _block_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, diag: bool) -> tuple[Tensor, Tensor]:
    """(softmax(q k^T) v, log-sum-exp of the scores) of one block; every query row sees a key."""
    s = _scores(q, k, scale, diag)
    row_max = s.amax(dim=-1, keepdim=True)
    p = s.sub_(row_max).exp_()
    total = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhgqk,bhkd->bhgqd", p, v).div_(total)
    return out, (row_max + total.log()).squeeze(-1)


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block's normalised output into the running (out, lse), in place: both are weighted by
    their share exp(lse_part - lse_new) of the joint softmax denominator. A row not seen yet has
    lse = -inf and weight 0."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _block_backward(q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, lse: Tensor, delta: Tensor, scale: float,
                    diag: bool, dq: Tensor, dk: Tensor, dv: Tensor) -> None:
    """Add one block's share to dq, dk and dv, recomputing its probabilities from the saved lse:
    P = exp(S - lse), dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)), dQ = dS K * scale,
    dK = dS^T Q * scale (summed over the g query heads of each K/V head)."""
    p = _scores(q, k, scale, diag).sub_(lse.unsqueeze(-1)).exp_()
    dv.add_(torch.einsum("bhgqk,bhgqd->bhkd", p, grad_out))
    dp = torch.einsum("bhgqd,bhkd->bhgqk", grad_out, v)
    ds = p.mul_(dp.sub_(delta.unsqueeze(-1)))
    dq.add_(torch.einsum("bhgqk,bhkd->bhgqd", ds, k), alpha=scale)
    dk.add_(torch.einsum("bhgqk,bhgqd->bhkd", ds, q), alpha=scale)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped_q(q: Tensor, kv_heads: int, dtype: torch.dtype) -> Tensor:
    """[b, s, h, d] -> [b, h_kv, g, s, d]: query head i uses K/V head i // g, as SDPA's enable_gqa."""
    b, s, h, d = q.shape
    return q.reshape(b, s, kv_heads, h // kv_heads, d).permute(0, 2, 3, 1, 4).to(dtype).contiguous()


def _ungrouped(x: Tensor, dtype: torch.dtype) -> Tensor:
    """[b, h_kv, g, s, d] -> [b, s, h, d]."""
    b, h_kv, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, h_kv * g, d).to(dtype)


class _RingAttention(torch.autograd.Function):
    """Ring attention with a hand-written backward.

    Forward keeps the normalised output and its log-sum-exp per query row, merging block after block
    (`_merge`); it saves q, k, v and the output (input dtype) and the lse (accumulation dtype,
    [b, h, s]). Backward recomputes each block's probabilities from the lse and adds its gradients:
    dq stays home, dk / dv accumulate on the travelling block and reach home with the last exchange
    (Note: [ring exchange]). Memory beyond the saved tensors: two K/V blocks and two dk / dv blocks in
    flight, the dq accumulator and one block's [b, h, s, s] scores (times three in backward).
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, group: Any, rank: int, world_size: int, layout: str,
                causal: bool, scale: float) -> Tensor:
        acc, s, kv_heads = _acc_dtype(q.dtype), q.shape[SEQ_DIM], k.shape[HEAD_DIM]
        qg = _grouped_q(q, kv_heads, acc)
        kv = torch.stack((k, v)).permute(0, 1, 3, 2, 4).contiguous()  # [2, b, h_kv, s, d], travels
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        for step in range(world_size):
            src = (rank - step) % world_size
            pending = _ring_send(kv, group, rank, world_size) if step < world_size - 1 else None
            for rows, cols, diag in _tiles(layout, causal, rank, src, world_size, s):
                k_blk, v_blk = kv[0, :, :, cols].to(acc), kv[1, :, :, cols].to(acc)
                block_out, block_lse = _block_forward(qg[..., rows, :], k_blk, v_blk, scale, diag)
                _merge(out[..., rows, :], lse[..., rows], block_out, block_lse)
            if pending is not None:
                kv = pending.wait()
        result = _ungrouped(out, q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.ring = (group, rank, world_size, layout, causal, scale)
        return result

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        group, rank, world_size, layout, causal, scale = ctx.ring
        acc, s, kv_heads = _acc_dtype(q.dtype), q.shape[SEQ_DIM], k.shape[HEAD_DIM]
        qg = _grouped_q(q, kv_heads, acc)
        do = _grouped_q(grad_out, kv_heads, acc)
        delta = (do * _grouped_q(out, kv_heads, acc)).sum(dim=-1)  # rowsum(dO * O)
        dq = torch.zeros_like(qg)
        kv = torch.stack((k, v)).permute(0, 1, 3, 2, 4).contiguous()
        dkv_in_flight = None
        for step in range(world_size):
            src = (rank - step) % world_size
            pending = _ring_send(kv, group, rank, world_size) if step < world_size - 1 else None
            dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)  # this step's share for block src
            for rows, cols, diag in _tiles(layout, causal, rank, src, world_size, s):
                k_blk, v_blk = kv[0, :, :, cols].to(acc), kv[1, :, :, cols].to(acc)
                _block_backward(qg[..., rows, :], k_blk, v_blk, do[..., rows, :], lse[..., rows],
                                delta[..., rows], scale, diag, dq[..., rows, :], dkv[0, :, :, cols],
                                dkv[1, :, :, cols])
            if dkv_in_flight is not None:  # block src's gradient from the ranks it visited before
                dkv.add_(dkv_in_flight.wait())
            if world_size > 1:
                dkv_in_flight = _ring_send(dkv, group, rank, world_size)
            if pending is not None:
                kv = pending.wait()
        if dkv_in_flight is not None:  # after P sends every block's gradient is home
            dkv = dkv_in_flight.wait()
        dk, dv = (t.permute(0, 2, 1, 3).to(k.dtype) for t in dkv)
        return _ungrouped(dq, q.dtype), dk, dv, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------------
# Public API


def _check_qkv(q: Tensor, k: Tensor, v: Tensor, where: str) -> None:
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if any(t.dim() != 4 for t in (q, k, v)):
        raise ValueError(f"{where}: {shapes}; expected 4-D [b, s, h, d] tensors (batch first, heads at dim 2).")
    if k.shape != v.shape:
        raise ValueError(f"{where}: {shapes}; k and v must have the same shape.")
    b, s, h, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, s, d):
        raise ValueError(f"{where}: {shapes}; q and k/v must agree in batch, local sequence length and head dim.")
    if k.shape[HEAD_DIM] == 0 or h % k.shape[HEAD_DIM]:
        raise ValueError(f"{where}: {h} query heads are not a multiple of the {k.shape[HEAD_DIM]} key/value "
                         f"heads ({shapes}); GQA needs every K/V head to serve the same number of query heads.")
    if s == 0:
        raise ValueError(f"{where}: {shapes}; the local sequence is empty.")
    if not q.is_floating_point() or q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"{where}: dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}; expected one floating dtype.")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"{where}: devices q {q.device}, k {k.device}, v {v.device}; expected one device.")


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: Any, *, causal: bool, layout: str = "contiguous",
                   scale: float | None = None) -> Tensor:
    """Attention over the whole sequence from this rank's slice, K/V going round the group.

    Equals torch's ``scaled_dot_product_attention`` over the whole sequence (``enable_gqa`` when k/v
    have fewer heads), restricted to this rank's positions (Note: [ring layout]); backward is exact too
    (hand-written, `_RingAttention`). Every rank of ``group`` must call it with the same shapes, dtype,
    ``causal`` and ``layout``. Communication: P - 1 (k, v) exchanges in forward, P - 1 (k, v) and P
    dk / dv exchanges in backward, each overlapped with a block's arithmetic; at most two K/V blocks
    are held (Note: [ring exchange]).

    Args:
        q: [b, s, h, d], this rank's s positions.
        k, v: [b, s, h_kv, d] with h a multiple of h_kv.
        group: the ring group: zeroshard ProcessGroups (a group of one needs no process group), or a torch
            process group as DeepSpeed passes them (None: zeroshard.comm's default group).
        causal: mask key positions after the query's, by global position.
        layout: "contiguous" or "zigzag" (causal load balance; needs an even s).
        scale: the score scale; default 1 / sqrt(d), as SDPA.

    Returns:
        The context, [b, s, h, d], in q's dtype (accumulated in fp32, fp64 for fp64 inputs).

    Raises:
        ValueError: tensors that are not [b, s, h, d], shapes that disagree, query heads not a multiple of
            the K/V heads, mixed dtypes or devices, an unknown layout, or zigzag with an odd s.
    """
    _check_layout(layout, "ring_attention")
    _check_qkv(q, k, v, "ring_attention")
    if layout == "zigzag" and q.shape[SEQ_DIM] % 2:
        raise ValueError(f"ring_attention: layout='zigzag' with an odd local sequence length {q.shape[SEQ_DIM]}: "
                         "each rank holds two equal chunks, so the local length must be even.")
    handle, rank, world_size = _group_info(group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, handle, rank, world_size, layout, causal, scale)


class RingAttention(nn.Module):
    """`ring_attention` as a module, the local attention of a sequence-parallel model.

    Args:
        group: the ring group (ProcessGroups, or a torch process group).
        causal: mask later positions (by global position).
        layout: "contiguous" or "zigzag" (Note: [ring layout]); the data must be laid out to match.
        scale: the score scale; default 1 / sqrt(d).

    Raises:
        ValueError: an unknown layout.

    Example::

        >>> attn = RingAttention(sp_group, causal=True, layout="zigzag")   # q, k, v: [b, s/P, h, d]
        >>> out = attn(q, k, v)                                            # out: [b, s/P, h, d]
    """

    def __init__(self, group: Any, causal: bool = True, layout: str = "contiguous",
                 scale: float | None = None) -> None:
        super().__init__()
        _check_layout(layout, "RingAttention")
        self.group, self.causal, self.layout, self.scale = group, causal, layout, scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """This rank's context, [b, s, h, d] (`ring_attention`)."""
        return ring_attention(q, k, v, self.group, causal=self.causal, layout=self.layout, scale=self.scale)


def ulysses_ring_groups(sp: ProcessGroups, ulysses_size: int) -> tuple[ProcessGroups, ProcessGroups]:
    """Split an SP group of P ranks into Ulysses groups of U consecutive ranks and ring groups across
    them (Note: [2D layout]). Collective over the world: every rank calls it with the same size.

    Args:
        sp: the sequence-parallel group.
        ulysses_size: U, dividing P. U = 1 is a plain ring, U = P plain Ulysses.

    Returns:
        (this rank's Ulysses group, this rank's ring group).

    Raises:
        ValueError: ``ulysses_size`` does not divide the group.
    """
    p = sp.world_size
    if ulysses_size < 1 or p % ulysses_size:
        fits = [d for d in range(1, p + 1) if p % d == 0]
        raise ValueError(f"ulysses_ring_groups: ulysses_size {ulysses_size} must divide the {p} ranks of the "
                         f"sequence-parallel group; use one of {fits}.")
    u, r = ulysses_size, p // ulysses_size
    ulysses = subgroup(sp, [[i * u + j for j in range(u)] for i in range(r)])
    ring = subgroup(sp, [[i * u + j for i in range(r)] for j in range(u)])
    return ulysses, ring


class UlyssesRingAttention(nn.Module):
    """2D sequence-parallel attention: Ulysses all-to-all inside each group of U ranks, the ring across
    the R groups (Note: [2D layout]). Trains models with fewer K/V heads than SP ranks exactly: U
    only has to divide the head counts, the ring takes any number of ranks.

    Args:
        ulysses_group: this rank's Ulysses group (`ulysses_ring_groups`), U ranks.
        ring_group: this rank's ring group, R ranks.
        causal: mask later positions (by global position).
        layout: the ring's layout (Note: [ring layout]); `shard_positions` with ``ulysses_size=U`` gives
            each SP rank's positions.
        scale: the score scale; default 1 / sqrt(d).

    Raises:
        ValueError: an unknown layout.

    Example::

        >>> ulysses, ring = ulysses_ring_groups(sp_groups, ulysses_size=2)   # 4 SP ranks: U = 2, R = 2
        >>> attn = UlyssesRingAttention(ulysses, ring, causal=True)
        >>> out = attn(q, k, v)                                            # [b, s/4, h, d] in and out
    """

    def __init__(self, ulysses_group: Any, ring_group: Any, causal: bool = True, layout: str = "contiguous",
                 scale: float | None = None) -> None:
        super().__init__()
        _check_layout(layout, "UlyssesRingAttention")
        self.ulysses_group, self.ring_group = ulysses_group, ring_group
        self.causal, self.layout, self.scale = causal, layout, scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """This rank's context, [b, s, h, d], from its [b, s, h, d] / [b, s, h_kv, d] slices.

        Raises:
            ValueError: as `ring_attention` (checked on this rank's slices and on the ring's blocks).
            NotSupportedError: a head count the Ulysses group size does not divide.
        """
        _check_qkv(q, k, v, "UlyssesRingAttention")
        handle, _, u = _group_info(self.ulysses_group)
        if u == 1:
            return ring_attention(q, k, v, self.ring_group, causal=self.causal, layout=self.layout, scale=self.scale)
        bad = {name: t.shape[HEAD_DIM] for name, t in (("query heads", q), ("key/value heads", k))
               if t.shape[HEAD_DIM] % u}
        if bad:
            what = ", ".join(f"{name} = {n}" for name, n in bad.items())
            raise NotSupportedError(
                f"UlyssesRingAttention: {what} cannot be split over the {u} ranks of the Ulysses group (each rank "
                f"gets a whole number of heads); use a Ulysses size dividing {k.shape[HEAD_DIM]} (1 is a plain "
                "ring, which takes any head count).")
        scale = 1.0 / math.sqrt(q.shape[-1]) if self.scale is None else self.scale
        q, k, v = (seq_all_to_all(t, handle, HEAD_DIM, SEQ_DIM) for t in (q, k, v))
        context = ring_attention(q, k, v, self.ring_group, causal=self.causal, layout=self.layout, scale=scale)
        return seq_all_to_all(context, handle, SEQ_DIM, HEAD_DIM)


__all__ = ["LAYOUTS", "RingAttention", "UlyssesRingAttention", "ring_attention", "shard_positions",
           "shard_sequence", "ulysses_ring_groups", "zigzag_indices", "zigzag_shard", "zigzag_unshard"]
