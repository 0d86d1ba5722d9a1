"""The optimizer the engine steps when the optimizer's home is NVMe: torch's Adam/AdamW settings
and parameter groups, its states in swap files (zero/offload/nvme_swap.py).

It is a `torch.optim.Optimizer` over the shard's fragments, so lr schedulers, `param_groups`
and checkpoints see what they see with CPU offload: `state[fragment]` reads that fragment's
`exp_avg` / `exp_avg_sq` from the swap files on demand (only checkpoints ask), and
`load_state_dict` writes a checkpoint's states into them. Other optimizers are refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from zeroshard.errors import ConfigError
from zeroshard.zero.offload.nvme_swap import AdamHyper, SwappedAdam


def _hyper(group: Mapping[str, Any], decoupled: bool) -> AdamHyper:
    for key in ("amsgrad", "maximize"):
        if group.get(key):
            raise ConfigError(f'offload_optimizer.device "nvme": optimizer option {key}=True is not '
                              'supported by the NVMe step; remove it or use "device": "cpu".')
    betas = group["betas"]
    return AdamHyper(lr=float(group["lr"]), betas=(float(betas[0]), float(betas[1])), eps=float(group["eps"]),
                     weight_decay=float(group["weight_decay"]), decoupled=decoupled)


class _SwapState(Mapping[Tensor, dict[str, Any]]):
    """`optimizer.state` over swap files: fragment -> {"step", "exp_avg", "exp_avg_sq"}."""

    def __init__(self, owner: "SwapAdam") -> None:
        self._owner = owner

    def __getitem__(self, p: Tensor) -> dict[str, Any]:
        i = self._owner._index.get(id(p))
        if i is None or self._owner.swap.step_count == 0:
            raise KeyError(p)
        swap = self._owner.swap
        shape = self._owner.fragments[i].shape
        return {"step": torch.tensor(float(swap.step_count)),
                "exp_avg": swap.fragment_state("exp_avg", i).view(shape),
                "exp_avg_sq": swap.fragment_state("exp_avg_sq", i).view(shape)}

    def __contains__(self, p: object) -> bool:
        return id(p) in self._owner._index and self._owner.swap.step_count > 0

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self._owner.fragments if self._owner.swap.step_count > 0 else [])

    def __len__(self) -> int:
        return len(self._owner.fragments) if self._owner.swap.step_count > 0 else 0


class SwapAdam(torch.optim.Optimizer):
    """Adam/AdamW with its states on NVMe, built from the torch optimizer it replaces.

    Args:
        inner: the torch.optim.Adam / AdamW built for the fragments (its groups are kept).
        fragments: the shard's fragment parameters, in shard order; each receives its updated
            values (cast to its dtype) at every step.
        swap: the swap files of this shard, with one fragment per entry of `fragments`.
        grads: the fragments' gradients at full precision (views of the gradient shard), read
            instead of `.grad`, which holds them cast to a low-precision fragment's dtype.
    """

    resident_state_bytes = 0  # the states live in files (runtime/optim.optimizer_state_bytes)

    def __init__(self, inner: torch.optim.Optimizer, fragments: Sequence[nn.Parameter], swap: SwappedAdam,
                 grads: Sequence[Tensor] | None = None) -> None:
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
            raise ConfigError(f'offload_optimizer.device "nvme" steps Adam/AdamW; the optimizer is '
                              f'{type(inner).__name__}. Use "device": "cpu" for other optimizers.')
        super().__init__(inner.param_groups, inner.defaults)
        self._decoupled = isinstance(inner, torch.optim.AdamW) or bool(inner.defaults.get("decoupled_weight_decay"))
        self.fragments, self.swap = list(fragments), swap
        self._grads = list(grads) if grads is not None else None
        self._staged: list[Tensor] | None = None
        self._index = {id(p): i for i, p in enumerate(self.fragments)}
        self.state = _SwapState(self)  # type: ignore[assignment]
        for g in self.param_groups:
            _hyper(g, self._decoupled)

    def _settings(self) -> list[AdamHyper]:
        hypers: list[AdamHyper | None] = [None] * len(self.fragments)
        for g in self.param_groups:
            h = _hyper(g, self._decoupled)
            for p in g["params"]:
                hypers[self._index[id(p)]] = h
        if any(h is None for h in hypers):
            raise AssertionError("a fragment of the NVMe shard is in no parameter group")
        return hypers  # type: ignore[return-value]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("the NVMe optimizer step takes no closure")
        self._staged = None  # a checkpoint's staged masters are stale once the master moves on
        if self._grads is not None:
            grads = self._grads
        else:
            grads = [p.grad if p.grad is not None else torch.zeros(p.shape) for p in self.fragments]
        self.swap.step_fragments([g.to("cpu", torch.float32) for g in grads], self._settings(), self.fragments)

    def write_master(self, *, from_params: bool = False) -> None:
        """The fp32 master from the staged values of a checkpoint load (`fetch_masters`), else
        from the fragments' current values (construction, weights-only loads)."""
        staged = None if from_params else self._staged
        if not from_params:
            self._staged = None
        for i, p in enumerate(self.fragments):
            values = staged[i] if staged is not None else p.detach().to("cpu", torch.float32)
            self.swap.load_fragment_state("master", i, values)

    def fetch_masters(self) -> list[Tensor]:
        """fp32 copies of each fragment's master, read from the swap file, for a checkpoint to
        save, or to fill on load (then `load_state_dict` writes them back). Temporarily one fp32
        copy of the shard in memory."""
        self._staged = [self.swap.fragment_state("master", i) for i in range(len(self.fragments))]
        return self._staged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        params = [p for g in self.param_groups for p in g["params"]]
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})
        steps = set()
        for idx, st in state_dict["state"].items():
            i = self._index[id(params[int(idx)])]
            for name in ("exp_avg", "exp_avg_sq"):
                self.swap.load_fragment_state(name, i, st[name])
            steps.add(int(st["step"]))
        if len(steps) > 1:
            raise ValueError(f"the checkpoint's fragments were stepped different numbers of times: {sorted(steps)}")
        self.swap.step_count = steps.pop() if steps else 0
        self.write_master()

    def close(self) -> None:
        self.swap.close()
