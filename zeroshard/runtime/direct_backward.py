"""A direct `loss.backward()` (DeepSpeed 0.19's "PyTorch-style backward") without engine.backward.

DeepSpeed 0.19.8 (runtime/engine.py) hooks the forward's output tensors: the first output
gradient of a backward pass runs the prologue (the accumulation boundary goes to the ZeRO
optimizer), every output gradient is divided by gradient_accumulation_steps, and a callback
queued on autograd's engine runs the epilogue (the reduction) once all gradients exist. Under
dynamic fp16 loss scaling it refuses a bare backward: the loss must be scaled through
`engine.scale(loss).backward()`. zeroshard does the same with the strategy's
`begin_micro_batch` / `after_backward`, at every stage (DeepSpeed refuses stage 0 with fp32 and
fp16; zeroshard's stage 0 reduces through the same calls, so it is supported there too).
Imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor


def output_tensors(out: Any) -> Iterator[Tensor]:
    """The tensors of a forward's output that carry a graph: a tensor, or tensors inside
    tuples, lists, dicts (HF ModelOutput is one) or dataclass-like objects' `__dict__`."""
    if isinstance(out, Tensor):
        if out.requires_grad:
            yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            yield from output_tensors(item)
    elif isinstance(out, Mapping):
        for item in out.values():
            yield from output_tensors(item)


def func_transforms() -> frozenset[str]:
    """The `torch.func` transforms the caller runs inside ("Grad", "Vmap", "Jvp", ...; empty
    outside any). A forward inside one is the transform's: its backward passes are the
    transform's own `torch.autograd.grad` of the function's inputs, not micro-batches. Read from
    torch's private interpreter stack, looked up defensively so a torch that moves it reads as
    "no transform"."""
    functorch = getattr(torch._C, "_functorch", None)
    stack = getattr(functorch, "get_interpreter_stack", None)
    if stack is None:
        return frozenset()
    return frozenset(level.key().name for level in (stack() or ()))


class DirectBackward:
    """Output hooks that turn a bare `backward()` of a forward's output into a micro-batch.

    `begin(first)` runs at the first output gradient of a backward pass that engine.backward
    did not start; it returns the factor every output gradient is multiplied by (1/gas) and
    the `end` callback queued for the end of that backward pass.
    """

    def __init__(self, begin: Callable[[], float], end: Callable[[], None]) -> None:
        self._begin, self._end = begin, end
        self.in_engine_backward = False
        self._factor: float | None = None  # set while a direct backward pass runs

    def attach(self, out: Any) -> None:
        for t in output_tensors(out):
            t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: Tensor) -> Tensor:
        if self.in_engine_backward:
            return grad
        if self._factor is None:
            self._factor = self._begin()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        return grad * self._factor if self._factor != 1.0 else grad

    def _finish(self) -> None:
        self._factor = None
        self._end()
