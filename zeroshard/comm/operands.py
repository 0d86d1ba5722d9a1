"""The tensors a collective takes: checks of its arguments (flat tensors, a root's list of one tensor
per rank, dtypes) and the copies in the communication dtype that travel in their place.

`Comm` (collectives.py) runs every collective on these; the errors name the argument and the fix.
Imports nothing of ours.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_flat(t: torch.Tensor, name: str) -> None:
    """Refuse a non-contiguous ``t`` (argument ``name``): collectives move flat buffers."""
    if not t.is_contiguous():
        raise ValueError(f"{name}: collectives need a contiguous tensor (a flat buffer); got "
                         f"shape {tuple(t.shape)} with strides {t.stride()}.")


def check_rank_list(op: str, arg: str, tensors: Sequence[torch.Tensor] | None, root: str, world: int,
                     numel: int, other: str) -> Sequence[torch.Tensor]:
    """The root's list of a scatter/gather: one flat tensor per rank, each of `numel` elements."""
    if tensors is None or len(tensors) != world:
        raise ValueError(f"{op}: {root} needs {arg} of {world} tensors, got "
                         f"{None if tensors is None else len(tensors)}.")
    for i, x in enumerate(tensors):
        check_flat(x, f"{arg}[{i}]")
        if x.numel() != numel:
            raise ValueError(f"{op}: {arg}[{i}] has {x.numel()} elements, {other} has {numel}.")
    return tensors


def comm_copy(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` itself, or a copy of it in ``dtype`` (input side: the data that travels)."""
    return t if dtype is None or dtype == t.dtype else t.to(dtype)


def comm_buffer(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` itself, or an uninitialised buffer of its shape in ``dtype`` (output side)."""
    return t if dtype is None or dtype == t.dtype else torch.empty_like(t, dtype=dtype)


def mixed_dtypes(out: torch.Tensor, in_: torch.Tensor, comm_dtype: torch.dtype | None) -> bool:
    """Input and output dtypes differ without a comm_dtype to say which one travels."""
    return out.dtype != in_.dtype and comm_dtype is None


def nbytes(t: torch.Tensor) -> int:
    """The bytes of ``t``'s elements (what the comm log counts)."""
    return t.numel() * t.element_size()
