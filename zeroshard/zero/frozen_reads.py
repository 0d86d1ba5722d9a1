"""When a stage-3 unit holding frozen parameters may be released in backward.

Note: [frozen parameters in backward] A unit's gradients all arriving usually means its
backward is over: every backward node that reads a trainable parameter also produces its
gradient. A frozen parameter (LoRA's base weights, a frozen embedding) is read by nodes that
produce only the gradient of their input, and autograd may run those after the unit's last
trainable gradient arrived (an adapter's nodes are newer than the base matmul's). So a unit with
frozen parameters is released only once, in addition, the gradient of every input that needed
one was computed for each module holding such a parameter (hooks on those inputs, counted per
forward; an input used elsewhere too only makes it later). A module whose inputs need no
gradient never reads its frozen weights in backward. What never gets its gradient waits for the
end of backward, as the persistent unit does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroshard.zero.units import tensors_in


class FrozenReads:
    """Per unit: the frozen-weight reads still to come in this backward.

    Args:
        num_units: the units' count.
        release: called with a unit whose gradients all arrived once its last read is done.
    """

    def __init__(self, num_units: int, release: Callable[[int], None]) -> None:
        self._pending = [0] * num_units
        self._awaiting: set[int] = set()
        self._release = release

    def install(self, root: nn.Module, unit_of_frozen: Mapping[int, int]) -> list[RemovableHandle]:
        """Watch the inputs of every module holding a frozen parameter (by id -> its unit); returns
        the hooks' handles. Hooks go after the units' own, so on the root the unit hook starts the
        forward first."""
        handles = []
        for module in root.modules():
            units = {unit_of_frozen[id(q)] for q in module.parameters(recurse=False) if id(q) in unit_of_frozen}
            for u in units:
                handles.append(module.register_forward_pre_hook(lambda m, a, kw, u=u: self._watch(u, a, kw),
                                                                with_kwargs=True))
        return handles

    def keep_eager(self) -> None:
        """Run the input watch outside compiled graphs (Note: [hooks under torch.compile] in
        zero/stage3.py): it registers tensor hooks, which a traced graph would not keep."""
        import torch._dynamo  # only a compiled engine imports it

        self._watch = torch._dynamo.disable(self._watch)  # type: ignore[method-assign]

    def reset(self) -> None:
        """A new forward, or the end of backward: nothing pending, nothing awaiting."""
        self._pending = [0] * len(self._pending)
        self._awaiting = set()

    def grads_arrived(self, u: int) -> bool:
        """Unit `u`'s last gradient arrived: True if it may be released now; otherwise it is
        released by the read that ends its pending ones."""
        if self._pending[u]:
            self._awaiting.add(u)
            return False
        return True

    def _watch(self, u: int, args: Any, kwargs: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for t in tensors_in((args, kwargs or {})):
            # A parameter passed in lives on: a hook per forward would pile up on it. Its
            # gradient arrives after the nodes that read it, as its own unit's arrivals count.
            if t.requires_grad and not isinstance(t, nn.Parameter):
                self._pending[u] += 1
                t.register_hook(lambda grad, u=u: self._read_done(u))

    def _read_done(self, u: int) -> None:
        self._pending[u] = max(0, self._pending[u] - 1)
        if not self._pending[u] and u in self._awaiting:
            self._awaiting.discard(u)
            self._release(u)
