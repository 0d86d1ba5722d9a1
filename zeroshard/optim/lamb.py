"""LAMB with DeepSpeed FusedLamb's hyper-parameters and update rule, vectorised with
``torch._foreach_*`` ops so it runs on any device. Imports only zeroshard.errors.

FusedLamb's rule, per parameter ``w`` with gradient ``g`` at step ``t`` (its CUDA kernel):

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g**2
    u = m / (sqrt(v) + eps) + weight_decay * w          # eps_inside_sqrt: m / sqrt(v + eps)
    ratio = clamp(||w|| / ||u||, min_coeff, max_coeff)  # 1.0 when ||w|| or ||u|| is 0
    w = w - step_size * ratio * u,   step_size = lr * sqrt(1 - beta2**t) / (1 - beta1**t)

Note the trust ratio uses the raw moments: bias correction only enters through ``step_size``
(as in FusedLamb), not through ``m_hat / (sqrt(v_hat) + eps)`` as in the LAMB paper.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from zeroshard.errors import ConfigError, NotSupportedError

ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]


class Lamb(torch.optim.Optimizer):
    """LAMB (layer-wise adaptive moments, https://arxiv.org/abs/1904.00962) as DeepSpeed's
    ``FusedLamb`` computes it (see the module docstring), for the config's ``"type": "Lamb"``.

    Each step updates all parameters of a group with a handful of ``torch._foreach_*`` calls;
    per-parameter norms come from ``torch._foreach_norm`` and the trust ratios are one vector op.
    State per parameter: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` (FusedLamb's names).

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        bias_correction: fold Adam's bias corrections into the step size.
        betas: moment decay rates (beta1, beta2).
        eps: added to ``sqrt(v)`` (or, with ``eps_inside_sqrt``, to ``v``).
        eps_inside_sqrt: use ``sqrt(v + eps)``.
        weight_decay: L2 term added to the update (inside the trust ratio).
        max_grad_norm: FusedLamb's per-group clipping; only 0 is supported (use the engine's
            ``gradient_clipping``).
        max_coeff, min_coeff: clamp of the trust ratio.
        amsgrad: not supported (as in FusedLamb).

    Raises:
        ConfigError: a hyper-parameter out of range; NotSupportedError for amsgrad / max_grad_norm.

    Example:
        >>> opt = Lamb(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> loss.backward(); opt.step(); opt.get_lamb_coeffs()   # one trust ratio per parameter
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise NotSupportedError("optimizer.params.amsgrad: Lamb has no AMSGrad variant (nor has FusedLamb)")
        if max_grad_norm:
            raise NotSupportedError(
                f"optimizer.params.max_grad_norm: got {max_grad_norm}; Lamb does not clip. "
                'Remove it and set "gradient_clipping" at the top level of the config.'
            )
        beta1, beta2 = betas
        checks: dict[str, tuple[object, bool, str]] = {
            "lr": (lr, lr >= 0, ">= 0"),
            "betas": (betas, 0 <= beta1 < 1 and 0 <= beta2 < 1, "two values in [0, 1)"),
            "eps": (eps, eps >= 0, ">= 0"),
            "weight_decay": (weight_decay, weight_decay >= 0, ">= 0"),
            "min_coeff": (min_coeff, 0 <= min_coeff <= max_coeff, f"in [0, max_coeff={max_coeff}]"),
        }
        for key, (value, ok, expected) in checks.items():
            if not ok:
                raise ConfigError(f"optimizer.params.{key}: got {value!r}, expected {expected}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=(float(beta1), float(beta2)), eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_coeff=max_coeff,
                        min_coeff=min_coeff)
        super().__init__(params, defaults)
        self._lamb_coeffs: list[Tensor] = []  # 1D per (group, device, dtype) bucket, last step

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step, one per updated parameter (group by group)."""
        return [c for t in self._lamb_coeffs for c in t.tolist()]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One LAMB step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._lamb_coeffs = []
        for group in self.param_groups:
            buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise NotSupportedError("Lamb does not support sparse gradients")
                buckets.setdefault((p.device, p.dtype), []).append(p)
            for params in buckets.values():
                self._step_bucket(group, params)
        return loss

    def _step_bucket(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """Update ``params`` (same device and dtype, all with gradients) of one group."""
        beta1, beta2 = group["betas"]
        grads: list[Tensor] = [_grad_of(p) for p in params]
        exp_avgs: list[Tensor] = []
        exp_avg_sqs: list[Tensor] = []
        step_sizes: list[float] = []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            step_sizes.append(self._step_size(group, state["step"]))

        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)

        if group["eps_inside_sqrt"]:
            denoms = torch._foreach_add(exp_avg_sqs, group["eps"])
            torch._foreach_sqrt_(denoms)
        else:
            denoms = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_add_(denoms, group["eps"])
        updates = torch._foreach_div(exp_avgs, denoms)
        del denoms
        if group["weight_decay"] != 0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])

        # Trust ratios for the whole bucket at once: 1D [n_params], in the norms' dtype.
        w_norms = torch.stack(torch._foreach_norm(params))
        u_norms = torch.stack(torch._foreach_norm(updates))
        ratio = (w_norms / u_norms).clamp_(group["min_coeff"], group["max_coeff"])
        ratio = torch.where((w_norms != 0) & (u_norms != 0), ratio, torch.ones_like(ratio))
        self._lamb_coeffs.append(ratio)
        scales = ratio * torch.tensor(step_sizes, dtype=ratio.dtype, device=ratio.device)
        # w -= step_size * ratio * u, one 0-d factor per parameter.
        torch._foreach_mul_(updates, list(scales.neg_().unbind(0)))
        torch._foreach_add_(params, updates)

    @staticmethod
    def _step_size(group: dict[str, Any], step: int) -> float:
        lr = float(group["lr"])
        if not group["bias_correction"]:
            return lr
        beta1, beta2 = group["betas"]
        return lr * math.sqrt(1.0 - float(beta2) ** step) / (1.0 - float(beta1) ** step)


def _grad_of(p: Tensor) -> Tensor:
    """The gradient in the parameter's dtype (FusedLamb also takes fp16 grads for fp32 params)."""
    grad = p.grad
    if grad is None:
        raise AssertionError("expected a parameter with a gradient")
    return grad if grad.dtype == p.dtype else grad.to(p.dtype)
