"""1-bit Lamb (DeepSpeed's `OneBitLamb`, https://arxiv.org/abs/2104.06069): LAMB whose momentum,
not its gradient, crosses the network as signs once the variance and the trust ratios have
settled. The rules below are DeepSpeed's (read in its `runtime/fp16/onebit/lamb.py`, which 0.19
no longer ships); where zeroshard departs, docs/deepspeed-differences.md ("1-bit Lamb") says why.

- *warm-up* (steps 1..`freeze_step`): LAMB without bias correction, on gradients all-reduced in
  full precision by the strategy. Per parameter `w` with gradient `g`:

      m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
      u = m / (sqrt(v) + eps) + weight_decay * w
      c = clamp(||w|| / ||u||, min_coeff, max_coeff)     (1 when either norm is 0)
      w -= lr * c * u

  and the trust ratio is tracked as `lamb_coeff_freeze = coeff_beta * lamb_coeff_freeze +
  (1 - coeff_beta) * c` (skipped when c is exactly 1). At step `freeze_step`, `v` is copied into
  `exp_avg_sq_fresh`.

- *compression* (after `freeze_step`): the strategy stops reducing gradients. `v` is frozen. Each
  rank folds its local gradient into the momentum, which is averaged by the error-feedback 1-bit
  all-reduce (optim/onebit_allreduce.py), each parameter's momentum first multiplied by its `scaling_coeff`
  (fixed at the first compressed step so that every parameter's momentum has the same RMS) and
  divided by it after. From the averaged momentum, a gradient is reconstructed,
  `g' = (m - b1 m_prev) / (1 - b1)`, and feeds `exp_avg_sq_fresh` (a variance that keeps moving).
  The update `u` uses the frozen `v`; its trust ratio is the frozen one times a factor:

      factor = max(denom / (sqrt(exp_avg_sq_fresh) + eps)),  denom = sqrt(v) + eps
      (with weight decay: factor = factor r + 1 - r,  r = min(1, ||m / denom|| / ||u||))
      factor clamped to [factor_min, factor_max], then to last_factor * (1 -+ factor_threshold)
      w -= lr * lamb_coeff_freeze * factor * u

At world size 1 nothing is communicated (as in DeepSpeed): the compression stage is the local rule.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from zeroshard.errors import ConfigError
from zeroshard.optim.onebit_adam import OneBitOptimizer, check_onebit_args

logger = logging.getLogger("zeroshard")


class OneBitLamb(OneBitOptimizer, torch.optim.Optimizer):
    """LAMB with a full-precision warm-up, then 1-bit compressed momentum averaging and a frozen,
    rescaled trust ratio (see the module docstring).

    Args:
        params: parameters or parameter groups (the engine's master parameters).
        lr, betas, eps, weight_decay: as Lamb (weight decay inside the trust ratio).
        freeze_step: steps of warm-up; compression starts at step `freeze_step + 1`.
        max_coeff, min_coeff: clamp of the warm-up trust ratio.
        coeff_beta: decay of the running average of the warm-up trust ratios.
        factor_max, factor_min: clamp of the compression-stage factor on the frozen ratio.
        factor_threshold: the most the factor may move between two steps, relative.
        comm_backend_name, cuda_aware: as OneBitAdam.

    State per parameter: `step`, `exp_avg`, `exp_avg_sq`, `exp_avg_sq_fresh`, `lamb_coeff_freeze`,
    `last_factor`, `scaling_coeff` (from the first compressed step), and the 1-bit errors of
    `OneBitOptimizer`.
    """

    def __init__(self, params: Iterable[Any], *, lr: float = 1e-3, freeze_step: int = 100000,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, coeff_beta: float = 0.9,
                 factor_max: float = 4.0, factor_min: float = 0.5, factor_threshold: float = 0.1,
                 comm_backend_name: str = "nccl", cuda_aware: bool = False) -> None:
        check_onebit_args(freeze_step, comm_backend_name, cuda_aware)
        checks: dict[str, tuple[object, bool, str]] = {
            "min_coeff": (min_coeff, 0 <= min_coeff <= max_coeff, f"in [0, max_coeff={max_coeff}]"),
            "coeff_beta": (coeff_beta, 0 <= coeff_beta < 1, "in [0, 1)"),
            "factor_min": (factor_min, 0 < factor_min <= factor_max, f"in (0, factor_max={factor_max}]"),
            "factor_threshold": (factor_threshold, 0 <= factor_threshold < 1, "in [0, 1)"),
        }
        for key, (value, ok, expected) in checks.items():
            if not ok:
                raise ConfigError(f"optimizer.params.{key}: got {value!r}, expected {expected}")
        beta1, beta2 = betas
        defaults = dict(lr=lr, betas=(float(beta1), float(beta2)), eps=eps, weight_decay=weight_decay,
                        max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self._init_onebit(freeze_step, comm_backend_name)
        self.coeff_beta, self.factor_max, self.factor_min = coeff_beta, factor_max, factor_min
        self.factor_threshold = factor_threshold
        self._lamb_coeffs: list[float] = []

    def __repr__(self) -> str:
        return (f"OneBitLamb(freeze_step={self.freeze_step}, steps={self.steps_taken}, "
                f"{'compressing' if self.compressing else 'warm-up'}, {self._allreduce!r})")

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratio each parameter was updated with in the last step (DeepSpeed's name)."""
        return list(self._lamb_coeffs)

    def _state(self, p: Tensor) -> dict[str, Any]:
        state = self.state[p]
        if "step" not in state:
            state["step"] = 0
            for key in ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"):
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["lamb_coeff_freeze"], state["last_factor"] = 0.0, 1.0
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self._check_attached()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._lamb_coeffs = []
        if self.compressing:
            self._compressed_step()
            return loss
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._warmup_step(group, params)
        self._after_warmup_step("the variance and trust ratios are")
        return loss

    def _warmup_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        beta1, beta2 = group["betas"]
        states = [self._state(p) for p in params]
        grads = [p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype) for p in params]  # type: ignore[union-attr]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        for s in states:
            s["step"] += 1
            if s["step"] == self.freeze_step:
                s["exp_avg_sq_fresh"].copy_(s["exp_avg_sq"])
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denoms, group["eps"])
        updates = torch._foreach_div(exp_avgs, denoms)
        if group["weight_decay"] > 0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        w_norms = torch.stack(torch._foreach_norm(params)).double()
        u_norms = torch.stack(torch._foreach_norm(updates)).double()
        ratio = (w_norms / u_norms).clamp_(group["min_coeff"], group["max_coeff"])
        coeffs = torch.where((w_norms != 0) & (u_norms != 0), ratio, torch.ones_like(ratio)).tolist()
        for s, c in zip(states, coeffs):
            if c != 1.0:
                s["lamb_coeff_freeze"] = self.coeff_beta * s["lamb_coeff_freeze"] + (1 - self.coeff_beta) * c
        self._lamb_coeffs += coeffs
        torch._foreach_mul_(updates, [-group["lr"] * c for c in coeffs])
        torch._foreach_add_(params, updates)

    def _scaling_coeffs(self) -> None:
        """At the first compressed step: each momentum's factor to the mean RMS of all of them."""
        params = self._params()
        rms = [float(self.state[p]["exp_avg"].norm()) / max(p.numel(), 1) ** 0.5 for p in params]
        united = sum(rms) / max(len(rms), 1)
        for p, r in zip(params, rms):
            # A momentum that is all zeros keeps factor 1 (DeepSpeed divides by its zero RMS).
            self.state[p]["scaling_coeff"] = united / r if r > 0 else 1.0

    def _compressed_step(self) -> None:
        params = self._params()
        if "scaling_coeff" not in self.state[params[0]]:
            self._scaling_coeffs()
        momenta, previous = [], []
        for group in self.param_groups:
            beta1 = group["betas"][0]
            for p in group["params"]:
                state = self.state[p]
                exp_avg = state["exp_avg"]
                previous.append(exp_avg.clone())
                if p.grad is not None:  # a parameter without a gradient keeps its momentum
                    exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                exp_avg.mul_(state["scaling_coeff"])
                momenta.append(exp_avg)
        self._average_momenta(momenta)
        i = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                state = self.state[p]
                exp_avg = state["exp_avg"].div_(state["scaling_coeff"])
                grad = (exp_avg - previous[i] * beta1) / (1 - beta1)
                i += 1
                state["exp_avg_sq_fresh"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = state["exp_avg_sq"].sqrt().add_(eps)
                prelim = exp_avg / denom
                update = prelim + wd * p if wd > 0 else prelim
                factor = float((denom / state["exp_avg_sq_fresh"].sqrt().add_(eps)).max())
                if wd > 0:
                    r = min(1.0, float(prelim.norm() / update.norm()))
                    factor = factor * r + (1.0 - r)
                factor = min(max(factor, self.factor_min), self.factor_max)
                last = state["last_factor"]
                factor = min(max(factor, last * (1.0 - self.factor_threshold)), last * (1.0 + self.factor_threshold))
                state["last_factor"] = factor
                coeff = state["lamb_coeff_freeze"] * factor
                self._lamb_coeffs.append(coeff)
                p.add_(update, alpha=-lr * coeff)
                state["step"] += 1

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the state (a Lamb or Adam checkpoint too: the keys 1-bit Lamb adds start as at a
        fresh start), then restore or reset the 1-bit errors as OneBitAdam does."""
        super().load_state_dict(state_dict)
        filled = False
        for p in self._params():
            state = self.state.get(p)
            if not state or "step" not in state:
                continue
            if "exp_avg_sq_fresh" not in state:
                state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
                filled = True
            state.setdefault("lamb_coeff_freeze", 0.0)
            state.setdefault("last_factor", 1.0)
            if isinstance(state["step"], Tensor):  # torch's Adam keeps a tensor step
                state["step"] = int(state["step"])
        if filled:
            logger.info("OneBitLamb: the checkpoint has no 1-bit Lamb state (a plain Lamb/Adam run); "
                        "exp_avg_sq_fresh starts from exp_avg_sq and the frozen trust ratio from 0")
        self._rebind_after_load()
