"""Tensor-parallel linear layers: local pieces as plain parameters, collectives as autograd functions.

Note: [why not DTensor parameters] torch's `parallelize_module` turns each sharded weight into a
DTensor `nn.Parameter`. zeroshard's ZeRO stages pack parameters into flat buffers and make
`param.data` a view of them (zero/flat.py), hook `register_post_accumulate_grad_hook` on plain
tensors, and at stage 3 swap the storage for a shard: none of that applies to a DTensor (its
`.data` is a wrapper around a local tensor, and its gradient is a DTensor too). So the TP pieces
are plain parameters holding this rank's slice of the global weight, and the Megatron
collectives that `ColwiseParallel` / `RowwiseParallel` insert are written out here as four
autograd functions over the tensor-parallel `Comm` (from `comm/topology.py`'s `tp` axis). The
maths is the same as torch's styles: a column-parallel layer copies its input (all-reduce of the
input gradient in backward) and keeps its output sharded (or gathers it, `gather_output`); a
row-parallel layer takes sharded input and all-reduces its output (identity in backward).

Imports torch, zeroshard.comm (types) and tensor_parallel/sequence only (torch._dynamo when compiling).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import zeroshard.tensor_parallel.sequence as sequence

if TYPE_CHECKING:
    from zeroshard.comm import Comm


def _all_reduce(comm: Comm, x: Tensor) -> Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, "sum")
    return out


class _CopyToTP(torch.autograd.Function):
    """Forward: identity. Backward: sum of the input gradients over the group."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(ctx.comm, grad), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: sum over the group. Backward: identity."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm) -> Tensor:
        return _all_reduce(comm, x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """Forward: concatenate the ranks' last dimensions. Backward: this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm) -> Tensor:
        ctx.comm, ctx.width = comm, x.shape[-1]
        local = x.contiguous()
        out = torch.empty((comm.world_size, *local.shape), dtype=x.dtype, device=x.device)
        comm.all_gather(out, local)
        return torch.cat(out.unbind(0), dim=-1)  # [..., world * width]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        start = ctx.comm.rank * ctx.width
        return grad.narrow(-1, start, ctx.width).contiguous(), None


class _ScatterToTP(torch.autograd.Function):
    """Forward: this rank's slice of the last dimension. Backward: gather the slices."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: Comm) -> Tensor:
        ctx.comm = comm
        width = x.shape[-1] // comm.world_size
        return x.narrow(-1, comm.rank * width, width).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _GatherFromTP.apply(grad, ctx.comm), None


COLLECTIVES = ("copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_tp")
"""The entry points above that run a collective in forward or backward."""


def keep_collectives_eager() -> None:
    """Note: [TP collectives under torch.compile] the tensor-parallel collectives run through
    zeroshard's `Comm` (gloo/NCCL process groups, buffers allocated here) inside autograd
    Functions whose backward is a collective too. Dynamo must not trace them: each entry point
    (`COLLECTIVES` here and in tensor_parallel/sequence.py) is rebound, once, to its
    `torch._dynamo.disable` form, so a compiled model breaks its graph at each and compiles the
    GEMMs and elementwise code between; the autograd Function runs eagerly, its backward between
    the compiled backward graphs (runtime/compile.py counts the breaks, which name these functions).
    The layers look the functions up at call time, so layers built earlier are covered; eager runs
    see the same functions (`disable` does nothing outside a compiled frame). Tracing them as
    torch's functional collectives instead would keep one graph, but needs the process groups as
    torch's and each backward rewritten; not built. Imports torch._dynamo (sequence.keep_eager)."""
    sequence.keep_collectives_eager()
    sequence.keep_eager(globals(), COLLECTIVES)


def copy_to_tp(x: Tensor, comm: Comm) -> Tensor:
    return _CopyToTP.apply(x, comm) if comm.world_size > 1 else x


def reduce_from_tp(x: Tensor, comm: Comm) -> Tensor:
    return _ReduceFromTP.apply(x, comm) if comm.world_size > 1 else x


def gather_from_tp(x: Tensor, comm: Comm) -> Tensor:
    return _GatherFromTP.apply(x, comm) if comm.world_size > 1 else x


def scatter_to_tp(x: Tensor, comm: Comm) -> Tensor:
    return _ScatterToTP.apply(x, comm) if comm.world_size > 1 else x


class ColumnParallelLinear(nn.Module):
    """`y = x W^T + b` with W split by output rows: this rank holds rows
    [rank * out/tp, (rank + 1) * out/tp) of the weight and bias.

    Args:
        linear: the whole `nn.Linear` (its values are sliced, not copied twice).
        comm: the tensor-parallel group.
        gather_output: all-gather the output's last dimension (a head whose output every rank needs).
    """

    linear_fn = staticmethod(F.linear)
    """The local GEMM; runtime/fp8.py's conversion sets a float8 one on the instance."""

    def __init__(self, linear: nn.Linear, comm: Comm, *, gather_output: bool = False,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        # Under sequence parallelism the block's input is gathered (and its gradient reduce-scattered)
        # where the attention / MLP module starts (tensor_parallel/sequence.py): no collective here.
        self.sequence_parallel = sequence_parallel
        self.gathers_sequence = sequence_parallel  # tensor_parallel/sequence.py gathers this module's input
        tp, r = comm.world_size, comm.rank
        out = linear.out_features
        self.comm, self.gather_output = comm, gather_output
        self.in_features, self.out_features = linear.in_features, out // tp
        rows = slice(r * out // tp, (r + 1) * out // tp)
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=linear.weight.requires_grad)
        self.bias = None if linear.bias is None else nn.Parameter(
            linear.bias.detach()[rows].clone(), requires_grad=linear.bias.requires_grad)

    def forward(self, x: Tensor) -> Tensor:
        if not self.sequence_parallel:
            x = copy_to_tp(x, self.comm)
        y = self.linear_fn(x, self.weight, self.bias)
        return gather_from_tp(y, self.comm) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (of "
                f"{self.out_features * self.comm.world_size}), gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """`y = x W^T + b` with W split by input columns: this rank holds columns
    [rank * in/tp, (rank + 1) * in/tp) and its input's matching slice; the partial products are
    summed over the group, then the (whole, replicated) bias is added.

    Args:
        linear: the whole `nn.Linear`.
        comm: the tensor-parallel group.
        input_is_parallel: the input is already this rank's slice (after a column-parallel layer);
            False scatters a whole input first.
    """

    linear_fn = staticmethod(F.linear)
    """The local GEMM; runtime/fp8.py's conversion sets a float8 one on the instance."""

    def __init__(self, linear: nn.Linear, comm: Comm, *, input_is_parallel: bool = True,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel  # output reduce-scattered along the sequence
        tp, r = comm.world_size, comm.rank
        inp = linear.in_features
        self.comm, self.input_is_parallel = comm, input_is_parallel
        self.in_features, self.out_features = inp // tp, linear.out_features
        cols = slice(r * inp // tp, (r + 1) * inp // tp)
        self.weight = nn.Parameter(linear.weight.detach()[:, cols].clone(),
                                   requires_grad=linear.weight.requires_grad)
        self.bias = None if linear.bias is None else nn.Parameter(
            linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.comm)
        if self.sequence_parallel and self.comm.world_size > 1:
            y = sequence.reduce_scatter_seq(self.linear_fn(x, self.weight), self.comm)
        else:
            y = reduce_from_tp(self.linear_fn(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (of {self.in_features * self.comm.world_size}), "
                f"out_features={self.out_features}")
