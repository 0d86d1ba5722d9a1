"""Sequence parallelism with tensor parallelism (Megatron's, torch's `SequenceParallel`): between the
tensor-parallel regions (norms, residual adds) each rank keeps 1/tp of the sequence.

A block's sub-modules holding column-parallel layers (attention, MLP) all-gather their input along
the sequence (reduce-scatter of its gradient in backward) where they start (Hugging Face's
attention takes its shapes from its input, so the gather cannot sit inside q/k/v), and their
column layers do no collective; row-parallel layers reduce-scatter their output along the sequence
instead of all-reducing it. The residual stream enters the first block cut to this
rank's sequence chunk and leaves the final norm gathered whole. Parameters used on a sequence
chunk (the blocks' norms, the final norm) see only their chunk's gradient: a hook sums it over the
tp group, so their gradients stay identical on every tp rank. Activations [batch, seq, hidden].
Imports torch, errors and zeroshard.comm (types) only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from zeroshard.errors import ConfigError, NotSupportedError

if TYPE_CHECKING:
    from zeroshard.comm import Comm

SEQ_DIM = 1


def _gather_seq(x: Tensor, comm: "Comm") -> Tensor:
    local = x.transpose(0, SEQ_DIM).contiguous()  # [s/tp, b, h]
    out = torch.empty((comm.world_size * local.shape[0], *local.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, local)
    return out.transpose(0, SEQ_DIM).contiguous()  # one [b, s, h] buffer (the matmuls would copy a strided view)


def _reduce_scatter_seq(x: Tensor, comm: "Comm") -> Tensor:
    whole = x.transpose(0, SEQ_DIM).contiguous()  # [s, b, h]
    out = torch.empty((whole.shape[0] // comm.world_size, *whole.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, whole)
    return out.transpose(0, SEQ_DIM).contiguous()


def _chunk(x: Tensor, comm: "Comm") -> Tensor:
    n = x.shape[SEQ_DIM] // comm.world_size
    return x.narrow(SEQ_DIM, comm.rank * n, n).contiguous()


class _SeqOp(torch.autograd.Function):
    """A collective along the sequence, `fwd(x, comm)`, whose backward is `bwd(grad, comm)`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: "Comm", fwd: Callable[[Tensor, "Comm"], Tensor],
                bwd: Callable[[Tensor, "Comm"], Tensor]) -> Tensor:
        ctx.comm, ctx.bwd = comm, bwd
        return fwd(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return ctx.bwd(grad, ctx.comm), None, None, None


def _gather_in(x: Tensor, comm: "Comm") -> Tensor:
    """Forward: all-gather along the sequence. Backward: reduce-scatter (a column layer's input)."""
    return _SeqOp.apply(x, comm, _gather_seq, _reduce_scatter_seq)


def _split(x: Tensor, comm: "Comm") -> Tensor:
    """Forward: this rank's sequence chunk of a whole activation. Backward: all-gather."""
    return _SeqOp.apply(x, comm, _chunk, _gather_seq)


def _join(x: Tensor, comm: "Comm") -> Tensor:
    """Forward: all-gather the chunks into the whole sequence. Backward: this rank's chunk (the
    whole gradient is the same on every tp rank: the head's input gradient is summed over tp)."""
    return _SeqOp.apply(x, comm, _gather_seq, _chunk)


def reduce_scatter_seq(x: Tensor, comm: "Comm") -> Tensor:
    """Forward: reduce-scatter along the sequence (a row layer's output). Backward: all-gather."""
    return _SeqOp.apply(x, comm, _reduce_scatter_seq, _gather_seq)


def keep_eager(namespace: dict[str, Any], names: tuple[str, ...]) -> None:
    """Rebind each function `names` in a module's `namespace` (its globals) to run outside any
    torch.compile graph (`torch._dynamo.disable`), once; see Note: [TP collectives under torch.compile]
    in tensor_parallel/layers.py. Imports torch._dynamo, which only a compiled engine pays for."""
    import torch._dynamo  # 2-4 s to import: only engines that compile pay for it

    for name in names:
        fn = namespace[name]
        if not getattr(fn, "_zs_eager", False):
            eager = torch._dynamo.disable(fn)
            eager._zs_eager = True  # type: ignore[attr-defined]
            namespace[name] = eager


COLLECTIVES = ("_gather_in", "_split", "_join", "reduce_scatter_seq")
"""This module's entry points that run a collective (Note: [TP collectives under torch.compile])."""


def keep_collectives_eager() -> None:
    """The sequence-parallel collectives run eagerly under torch.compile (graph breaks around them)."""
    keep_eager(globals(), COLLECTIVES)


def _first(value: Any) -> Tensor:
    return value[0] if isinstance(value, tuple) else value


def enable_sequence_parallel(model: nn.Module, comm: "Comm", split: set[str]) -> None:
    """Cut the residual stream of `model`'s blocks along the sequence (after `shard_model` with
    sequence-parallel layers). The model must have Hugging Face's layout: `base_model.layers`
    (the blocks) and `base_model.norm` (the final norm).

    Raises:
        NotSupportedError: the model lacks that layout.
    """
    base = getattr(model, "base_model", model)
    layers, norm = getattr(base, "layers", None), getattr(base, "norm", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers) or not isinstance(norm, nn.Module):
        raise NotSupportedError(f"not supported yet: sequence parallelism on {type(model).__name__}; it needs a "
                                "Hugging Face layout (base_model.layers blocks and a base_model.norm).")

    def cut(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            x = args[0]
            if x.shape[SEQ_DIM] % comm.world_size:
                raise ConfigError(f"sequence parallelism: sequence length {x.shape[SEQ_DIM]} is not divisible by "
                                  f"the tensor-parallel size {comm.world_size}; pad the batch.")
            return (_split(x, comm), *args[1:]), kwargs
        x = kwargs["hidden_states"]
        return args, {**kwargs, "hidden_states": _split(x, comm)}

    layers[0].register_forward_pre_hook(cut, with_kwargs=True)

    def gather(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (_gather_in(args[0], comm), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": _gather_in(kwargs["hidden_states"], comm)}

    for block in layers:
        for child in block.children():
            # a column-parallel layer under sequence parallelism (tensor_parallel/layers.py) marks itself
            if any(getattr(m, "gathers_sequence", False) for m in child.modules()):
                child.register_forward_pre_hook(gather, with_kwargs=True)
    norm.register_forward_hook(lambda _m, _a, out: _join(_first(out), comm))

    def summed(g: Tensor) -> Tensor:
        g = g.contiguous().clone()
        comm.all_reduce(g)
        return g

    names = {id(p): n for n, p in model.named_parameters()}
    for module in [*layers, norm]:
        for p in module.parameters():
            full = f"{names[id(p)]}"
            if full not in split and p.requires_grad:
                p.register_hook(summed)  # this chunk's contribution: summed over the tp group
