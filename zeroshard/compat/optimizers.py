"""DeepSpeed's optimizer classes as scripts and Accelerate construct them, on torch's kernels.

`DeepSpeedCPUAdam` and `FusedAdam` are torch's Adam with DeepSpeed's constructor signature:
`adamw_mode` / `adam_w_mode` selects decoupled weight decay, and the fused kernel is used where
torch has one for the parameters' device (CPU included). The engine recognises them as torch
Adam, so under CPU offload they step on the CPU master shard with the fused CPU kernel.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zeroshard.errors import NotSupportedError


def _fused_ok(params: list[Any]) -> bool:
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    devices = {t.device.type for t in tensors}
    return bool(tensors) and devices <= {"cpu", "cuda", "xpu", "mps"} and \
        all(t.is_floating_point() for t in tensors)


class _DeepSpeedAdam(torch.optim.Adam):
    _name = "Adam"

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                 **kwargs: Any) -> None:
        if not bias_correction:
            raise NotSupportedError(f"{type(self).__name__}(bias_correction=False) is not supported: "
                                    "torch's Adam always corrects the bias; remove the argument")
        if amsgrad:
            raise NotSupportedError(f"{type(self).__name__}(amsgrad=True): DeepSpeed refuses it too; "
                                    "use torch.optim.Adam(amsgrad=True) as a client optimizer")
        kwargs.pop("fp32_optimizer_states", None)
        kwargs.pop("set_grad_none", None)
        if kwargs:
            raise TypeError(f"{type(self).__name__}: unexpected arguments {sorted(kwargs)}")
        params = list(params)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         fused=True if _fused_ok(params) else None,
                         decoupled_weight_decay=adamw_mode)
        self.adam_w_mode = adamw_mode


class DeepSpeedCPUAdam(_DeepSpeedAdam):
    """DeepSpeed's CPU Adam: torch's fused CPU Adam/AdamW (same update, vectorised)."""


class FusedAdam(_DeepSpeedAdam):
    """DeepSpeed's FusedAdam: torch's fused Adam/AdamW; `adam_w_mode` as DeepSpeed spells it."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True) -> None:
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adamw_mode=adam_w_mode)


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's CPU Adagrad: torch's Adagrad with DeepSpeed's constructor signature."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10,
                 weight_decay: float = 0.0, amsgrad: bool = False, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise NotSupportedError("DeepSpeedCPUAdagrad(amsgrad=True) is not supported (nor by DeepSpeed)")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)


class DeepSpeedCPULion:
    """Lion is not built: torch has no Lion kernel and zeroshard has not written one yet."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedError(
            f"{type(self).__name__}: the Lion optimizer is not supported by zeroshard yet; use "
            "AdamW (optimizer.type \"AdamW\") or pass your own torch optimizer to initialize()")


class FusedLion(DeepSpeedCPULion):
    """See DeepSpeedCPULion."""
