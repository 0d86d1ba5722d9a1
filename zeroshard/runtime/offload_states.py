"""`engine.offload_states()` / `reload_states()` (DeepSpeed 0.16+): free the accelerator memory
of the training states between training phases, and bring them back.

RLHF loops train a model, then generate with it (or with another engine) on the same devices;
the optimizer states, master weights and gradient buffers sit idle meanwhile. DeepSpeed's
`offload_states(include=, device="cpu", pin_memory=, non_blocking=)` moves them to host memory
and `reload_states()` moves them back.

Note: [offload by storage] Each state is a set of storages (flat buffers, shards, the
optimizer's tensors), most of them viewed by many tensors: parameters, fragments, `.grad`s,
autograd. Instead of re-pointing every view at a host copy, the bytes of each storage are
copied to a host buffer and the storage itself is resized to 0 (as stage 3 releases a unit,
Note: [released storage] in zero/stage3.py); `reload_states()` resizes it back and copies the
bytes in. Every view, wherever it is held, sees the same values again, and nothing can read a
stale copy meanwhile: the engine refuses forward, backward, step and checkpoints until the
reload, and any other read of an offloaded tensor raises. A storage shared by two states (fp32
master weights that are the parameters themselves) moves only when both are included, so
`include=[optim_states, hp_params]` never takes away the parameters a generation phase reads.
Storages already on the target device (offloaded optimizer, CPU training) stay where they are.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor
from torch._C import DisableTorchFunctionSubclass

from zeroshard.errors import UsageError

logger = logging.getLogger("zeroshard")

STATES = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")
"""DeepSpeed's `OffloadStateTypeEnum` values, the states `offload_states(include=)` names."""


@dataclass
class _Held:
    storage: torch.UntypedStorage
    host: Tensor  # uint8, the storage's bytes


def _name(state: Any) -> str:
    value = state.value if isinstance(state, Enum) else state
    if value not in STATES:
        raise ValueError(f"offload_states(include=...): unknown state {state!r}; the states are "
                         f"{', '.join(STATES)} (deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum)")
    return str(value)


def resolve_include(include: Iterable[Any] | None) -> set[str]:
    """`include` as state names (None: all of them); an unknown one raises ValueError."""
    if include is None:
        return set(STATES)
    if isinstance(include, (str, Enum)):
        include = [include]
    return {_name(s) for s in include}


def resolve_device(device: Any) -> str | None:
    """"cpu", or None for DeepSpeed's "none" (nothing to do); NVMe and others raise ValueError."""
    value = device.value if isinstance(device, Enum) else str(device)
    if value == "none":
        return None
    if value != "cpu":
        raise ValueError(f"offload_states(device={value!r}): only \"cpu\" is supported (as in DeepSpeed, "
                         "which refuses NVMe for offloading states)")
    return value


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[Tensor]:
    """Every tensor in the optimizer's per-parameter state (exp_avg, exp_avg_sq, step, ...)."""
    if optimizer is None:
        return []
    inner = getattr(optimizer, "optimizer", optimizer)  # a wrapper's torch optimizer
    return [v for state in inner.state.values() for v in state.values() if isinstance(v, Tensor)]


class StateOffload:
    """The storages one `offload_states()` took, until `reload_states()` gives them back."""

    def __init__(self) -> None:
        self._held: list[_Held] = []
        self.states: set[str] = set()

    @property
    def active(self) -> bool:
        return bool(self.states)

    def offload(self, tensors: Mapping[str, Iterable[Tensor]], include: set[str], *, pin_memory: bool,
                non_blocking: bool, move_host_storages: bool = False) -> int:
        """Copy out and free every storage all of whose states are in `include` and that is not
        on the host already (`move_host_storages`: those too, which is how the mechanism is
        tested on a machine without an accelerator). Returns the bytes freed."""
        if self.active:
            raise UsageError("offload_states() twice: the states are already offloaded; call "
                             "reload_states() first")
        owners: dict[int, tuple[torch.UntypedStorage, set[str]]] = {}
        with DisableTorchFunctionSubclass():
            for state, ts in tensors.items():
                for t in ts:
                    storage = t.untyped_storage()
                    if storage.nbytes() == 0:
                        continue
                    owners.setdefault(storage.data_ptr(), (storage, set()))[1].add(state)
        pin = pin_memory and torch.cuda.is_available()
        freed = 0
        for storage, states in owners.values():
            if not states <= include or (storage.device.type == "cpu" and not move_host_storages):
                continue
            data = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
            host.copy_(data, non_blocking=non_blocking and pin)
            del data
            self._held.append(_Held(storage, host))
            freed += storage.nbytes()
        for held in self._held:  # after every copy was issued (stream order keeps them valid)
            held.storage.resize_(0)
        self.states = set(include)
        return freed

    def reload(self, *, non_blocking: bool) -> int:
        """Give every storage its bytes back; returns how many bytes came back."""
        back = 0
        for held in self._held:
            held.storage.resize_(held.host.numel())
            data = torch.empty(0, dtype=torch.uint8, device=held.storage.device).set_(held.storage)
            data.copy_(held.host, non_blocking=non_blocking and held.host.is_pinned())
            back += held.host.numel()
        self._held.clear()
        self.states = set()
        return back
