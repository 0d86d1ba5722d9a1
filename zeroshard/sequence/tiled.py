"""Tiled compute for long sequences (ALST's `TiledMLP`, `SequenceTiledCompute`, `TiledFusedLogitsLoss`):
a per-token function run over the sequence tile by tile, so that its intermediates (an MLP's 4x-wide
activations, a `[seq, vocab]` logits tensor) exist for one tile at a time.

DeepSpeed's versions (`deepspeed.runtime.sequence_parallel.ulysses_sp`, same call signatures here)
recompute each tile in backward and let every tile's backward accumulate into the parameters'
``.grad``, flagging ZeRO with ``param.ds_grad_is_ready`` until the last tile. zeroshard's ZeRO
reduces a parameter when its gradient arrives once per backward, so here the tiles' parameter
gradients are computed with `torch.autograd.grad` (nothing accumulates, no hook fires), summed, and
returned from the autograd node as the gradients of the parameters, which are the node's inputs: each
parameter's gradient arrives once, at the node, as for any other layer (Note: [tiled gradients]).
`compute_params` (DeepSpeed's hint for ZeRO) names those parameters; when it is None every parameter
of `module` that requires a gradient is used.

Memory: forward keeps only the input (and for the loss the input's gradient); one tile's
intermediates are alive at a time, in forward and in backward. Compute: each tile runs forward twice
(once more with activation checkpointing), as in DeepSpeed. Imports torch only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn


def _params(module: Any, compute_params: Sequence[Tensor] | None) -> list[Tensor]:
    """The parameters a tile's gradient is taken for: those given, or the module's, requiring grad."""
    source = compute_params if compute_params is not None else (
        module.parameters() if isinstance(module, nn.Module) else ())
    seen: dict[int, Tensor] = {}
    for p in source:
        if p.requires_grad:
            seen.setdefault(id(p), p)
    return list(seen.values())


def _tile_grads(out: Tensor, grad_out: Tensor | None, inputs: list[Tensor]) -> list[Tensor]:
    """Gradients of `out` (weighted by `grad_out`) for `inputs`; zeros for an input it does not use."""
    grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
    return [torch.zeros_like(i) if g is None else g for g, i in zip(grads, inputs)]


class _TiledMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Tensor], module: Any, x: Tensor, shards: int, *params: Tensor) -> Tensor:
        ctx.fn, ctx.module, ctx.shards = fn, module, shards
        ctx.save_for_backward(x, *params)
        with torch.no_grad():
            return torch.cat([fn(module, tile) for tile in torch.chunk(x, shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        x, *params = ctx.saved_tensors
        want_x = ctx.needs_input_grad[2]
        x_grad = torch.zeros_like(x) if want_x else None
        p_grads = [torch.zeros_like(p) for p in params]
        start = 0
        for x_tile, g_tile in zip(torch.chunk(x, ctx.shards, dim=-2), torch.chunk(grad, ctx.shards, dim=-2)):
            tile = x_tile.detach().requires_grad_(want_x)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, tile)
            grads = _tile_grads(out, g_tile, ([tile] if want_x else []) + params)
            if x_grad is not None:
                x_grad.narrow(-2, start, tile.shape[-2]).copy_(grads.pop(0))
            for acc, g in zip(p_grads, grads):
                acc.add_(g)
            start += tile.shape[-2]
        return (None, None, x_grad, None, *p_grads)


class TiledMLP:
    """An MLP (any per-token function of the hidden states) run over the sequence in `shards` tiles.

    ``TiledMLP.apply(fn, module, x, shards, compute_params)`` returns ``fn(module, x)`` computed tile
    by tile along dim -2 (the sequence of ``[batch, seq, hidden]``), DeepSpeed's call shape. Exact:
    the value and every gradient equal the untiled call's up to summation order.

    Example::

        def tiled_forward(self, x):                      # monkey-patch LlamaMLP.forward
            shards = max(1, math.ceil(x.shape[1] / x.shape[2]))
            return TiledMLP.apply(lambda m, t: m.down_proj(m.act_fn(m.gate_proj(t)) * m.up_proj(t)),
                                  self, x, shards, None)
    """

    @staticmethod
    def apply(fn: Callable[..., Tensor], module: Any, x: Tensor, shards: int,
              compute_params: Sequence[Tensor] | None = None) -> Tensor:
        """Args: `fn(module, x_tile)`; `module` passed through; `x` ``[..., seq, hidden]``; `shards`
        tiles (at least 1); `compute_params` the parameters `fn` uses (default: `module`'s)."""
        _check_shards(shards)
        return _TiledMLPFunction.apply(fn, module, x, shards, *_params(module, compute_params))


def _check_shards(shards: int) -> None:
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards: got {shards!r}, expected an integer >= 1 (the number of tiles)")


Reduction = str | None


def _reduce(outputs: list[Tensor], dim: int, reduction: Reduction) -> Tensor:
    whole = torch.stack(outputs) if dim == 0 else torch.cat(outputs, dim=dim)
    if reduction is None:
        return whole
    return whole.mean() if reduction == "mean" else whole.sum()


def _tile_grad_out(grad: Tensor, outputs: list[Tensor], i: int, start: int, dim: int, reduction: Reduction) -> Tensor:
    """The gradient reaching tile `i`'s output from the gradient of the reduced, untiled output."""
    out = outputs[i]
    if reduction is not None:
        total = sum(o.numel() for o in outputs)
        return (grad / total if reduction == "mean" else grad).expand_as(out)
    return grad[i] if dim == 0 else grad.narrow(dim, start, out.shape[dim])


class _SequenceTiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Tensor], seqlen: int, shards: int, keys_to_shard: list[str],
                keys_to_pass: list[str], grad_key: str, dim: int, reduction: Reduction, n_params: int,
                *args: Any) -> Tensor:
        values = list(args)
        sharded = dict(zip(keys_to_shard, values[:len(keys_to_shard)]))
        passed = dict(zip(keys_to_pass, values[len(keys_to_shard):len(keys_to_shard) + len(keys_to_pass)]))
        params = values[len(values) - n_params:] if n_params else []
        ctx.fn, ctx.step, ctx.dim, ctx.reduction, ctx.passed = fn, math.ceil(seqlen / shards), dim, reduction, passed
        ctx.keys, ctx.grad_key, ctx.n_args = keys_to_shard, grad_key, len(args)
        ctx.grad_index = (keys_to_shard + keys_to_pass).index(grad_key)
        ctx.save_for_backward(*sharded.values(), *params)
        with torch.no_grad():
            outputs = [fn(**tile, **passed) for tile in _tiles(sharded, ctx.step, seqlen)]
        ctx.shapes = [o.shape for o in outputs]
        return _reduce(outputs, dim, reduction)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        saved = list(ctx.saved_tensors)
        sharded = dict(zip(ctx.keys, saved[:len(ctx.keys)]))
        params = saved[len(ctx.keys):]
        x = sharded[ctx.grad_key]
        want_x = x.requires_grad or ctx.needs_input_grad[9 + ctx.grad_index]
        x_grad = torch.zeros_like(x) if want_x else None
        p_grads = [torch.zeros_like(p) for p in params]
        outputs = [torch.empty(shape, device=grad.device, dtype=grad.dtype) for shape in ctx.shapes]
        start_out, start_x = 0, 0
        for i, tile in enumerate(_tiles(sharded, ctx.step, x.shape[1])):
            tile[ctx.grad_key] = tile[ctx.grad_key].detach().requires_grad_(want_x)
            with torch.enable_grad():
                out = ctx.fn(**tile, **ctx.passed)
            g = _tile_grad_out(grad, outputs, i, start_out, ctx.dim, ctx.reduction)
            grads = _tile_grads(out, g, ([tile[ctx.grad_key]] if want_x else []) + params)
            if x_grad is not None:
                x_grad.narrow(1, start_x, tile[ctx.grad_key].shape[1]).copy_(grads.pop(0))
            for acc, gp in zip(p_grads, grads):
                acc.add_(gp)
            start_out += out.shape[ctx.dim] if ctx.dim != 0 else 0
            start_x += tile[ctx.grad_key].shape[1]
        arg_grads: list[Any] = [None] * (ctx.n_args - len(params)) + p_grads
        arg_grads[ctx.grad_index] = x_grad
        return (None,) * 9 + tuple(arg_grads)


def _tiles(sharded: dict[str, Tensor], step: int, seqlen: int) -> list[dict[str, Tensor]]:
    return [{k: v[:, start:start + step] for k, v in sharded.items()} for start in range(0, seqlen, step)]


def sequence_tiled_compute(fn: Callable[..., Tensor], seqlen: int, shards: int, kwargs_to_shard: dict[str, Tensor],
                           kwargs_to_pass: dict[str, Any], grad_requiring_tensor_key: str,
                           compute_params: Sequence[Tensor] | None = None, output_unshard_dimension: int = 1,
                           output_reduction: Reduction = "mean") -> Tensor:
    """``fn(**kwargs_to_shard, **kwargs_to_pass)`` computed over ``shards`` tiles of the sequence (dim 1
    of every `kwargs_to_shard` tensor), DeepSpeed's `sequence_tiled_compute` signature.

    Args:
        fn: the per-tile function.
        seqlen: the length of dim 1.
        shards: how many tiles (each ``ceil(seqlen / shards)`` long, the last shorter).
        kwargs_to_shard: tensors ``[batch, seq, ...]`` cut along the sequence.
        kwargs_to_pass: passed whole to every call.
        grad_requiring_tensor_key: the key of `kwargs_to_shard` whose gradient is returned.
        compute_params: the parameters `fn` uses (their gradients are returned once, summed over
            tiles); None: none (a function without parameters).
        output_unshard_dimension: 1 concatenates the tiles' outputs along the sequence; 0 stacks them
            (a scalar per tile, e.g. a loss).
        output_reduction: None (the concatenated output), "mean" or "sum" of it.

    Returns:
        The reduced (or concatenated) output, as the untiled call would give it.
    """
    _check_shards(shards)
    if output_reduction not in (None, "mean", "sum"):
        raise ValueError(f"unknown value {output_reduction}: valid values are: none/mean/sum")
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not a key of kwargs_to_shard "
                         f"({sorted(kwargs_to_shard)})")
    params = _params(None, compute_params) if compute_params is not None else []
    return _SequenceTiledFunction.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                        grad_requiring_tensor_key, output_unshard_dimension, output_reduction,
                                        len(params), *kwargs_to_shard.values(), *kwargs_to_pass.values(), *params)


class SequenceTiledCompute:
    """DeepSpeed's autograd function behind `sequence_tiled_compute`, with its positional `apply`."""

    @staticmethod
    def apply(fn: Callable[..., Tensor], seqlen: int, shards: int, keys_to_shard: list[str], keys_to_pass: list[str],
              grad_requiring_tensor_key: str, compute_params: Sequence[Tensor] | None, output_unshard_dimension: int,
              output_reduction: Reduction, *args: Any) -> Tensor:
        n = len(keys_to_shard)
        return sequence_tiled_compute(fn, seqlen, shards, dict(zip(keys_to_shard, args[:n])),
                                      dict(zip(keys_to_pass, args[n:])), grad_requiring_tensor_key, compute_params,
                                      output_unshard_dimension, output_reduction)


class _FusedLogitsLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[..., Tensor], module: Any, x: Tensor, y: Tensor, mask: Tensor | None,
                shards: int, reduction: str, *params: Tensor) -> Tensor:
        want_x = ctx.needs_input_grad[2]
        bs_seq = x.shape[:2]
        flat_x = x.detach().reshape(-1, *x.shape[2:])
        flat_y, flat_mask = y.reshape(-1, *y.shape[2:]), mask.reshape(-1) if mask is not None else None
        x_grad = torch.zeros_like(flat_x) if want_x else None
        p_grads = [torch.zeros_like(p) for p in params]
        weight = 1.0 / shards if reduction == "mean" else 1.0
        outputs, start = [], 0
        for i, (x_t, y_t) in enumerate(zip(torch.chunk(flat_x, shards), torch.chunk(flat_y, shards))):
            tile = x_t.detach().requires_grad_(want_x)
            extra = (torch.chunk(flat_mask, shards)[i],) if flat_mask is not None else ()
            with torch.enable_grad():
                out = fn(module, tile, y_t, *extra)
                inputs = ([tile] if want_x else []) + list(params)
                grads = _tile_grads(out, torch.full_like(out, weight), inputs) if inputs else []
            if x_grad is not None:
                x_grad.narrow(0, start, tile.shape[0]).copy_(grads.pop(0))
            for acc, g in zip(p_grads, grads):
                acc.add_(g)
            outputs.append(out.detach())
            start += tile.shape[0]
        ctx.save_for_backward(*([x_grad.view(*bs_seq, *x_grad.shape[1:])] if x_grad is not None else []), *p_grads)
        ctx.want_x = want_x
        return _reduce(outputs, 0, reduction)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        saved = list(ctx.saved_tensors)
        x_grad = saved.pop(0) * grad if ctx.want_x else None
        return (None, None, x_grad, None, None, None, None, *[g * grad for g in saved])


class TiledFusedLogitsLoss:
    """A loss over logits computed tile by tile, so that the whole ``[seq, vocab]`` logits never exist.

    ``TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params, output_reduction)``:
    ``fn(module, x_tile, y_tile[, mask_tile])`` returns a tile's loss (a scalar); the result is the
    mean or the sum of the tiles' losses (DeepSpeed's call shape). As in DeepSpeed the backward runs
    inside the forward (the loss is the last node of the graph), so nothing is recomputed; the
    gradients are held until the engine's backward delivers them.

    Raises:
        ValueError: an unknown reduction, or shapes that do not pair up (DeepSpeed's checks).
    """

    @staticmethod
    def apply(fn: Callable[..., Tensor], module: Any, x: Tensor, y: Tensor, mask: Tensor | None, shards: int,
              compute_params: Sequence[Tensor] | None = None, output_reduction: str = "mean") -> Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f'unknown reduction {output_reduction}: valid values are: "mean"/"sum"')
        if x.dim() < 2 or y.dim() < 2:
            raise ValueError(f"x and y must be at least 2D [batch_size, seq_len, ...], got {tuple(x.shape)} and "
                             f"{tuple(y.shape)}")
        if x.shape[:2] != y.shape[:2]:
            raise ValueError(f"x and y batch/seq dims must match: {tuple(x.shape[:2])} != {tuple(y.shape[:2])}")
        if mask is not None and (mask.dim() != 2 or mask.shape != x.shape[:2]):
            raise ValueError(f"mask must be [batch_size, seq_len] = {tuple(x.shape[:2])}, got {tuple(mask.shape)}")
        _check_shards(shards)
        return _FusedLogitsLossFunction.apply(fn, module, x, y, mask, shards, output_reduction,
                                              *_params(module, compute_params))
