"""0/1 Adam (DeepSpeed's `ZeroOneAdam`, https://arxiv.org/abs/2202.06009): Adam that updates its
variance on an exponentially thinning schedule, sends 1-bit compressed gradients or momenta
in between, and after `var_freeze_step` skips communication on "local" steps.

Two phases, both functions of the step count `t` alone (so a resumed run follows the same
schedule; `variance_update_step`, `local_step_interval`):

- *variance phase* (`t <= var_freeze_step`): on a variance step (the first `var_update_scaler`
  steps, then every 2nd step for `var_update_scaler` more, then every 4th, ...) the strategy
  all-reduces the gradient in full precision and both moments are updated,
  `v = b2 v + (1 - b2) g^2`, `m = b1 m + (1 - b1) g`. On the other steps the strategy keeps each
  rank's gradient (`set_grad_reduction(False)`), the gradients are averaged by the 1-bit
  error-feedback all-reduce of optim/onebit_allreduce.py and only the momentum takes them.
- *local-step phase* (`t > var_freeze_step`): the variance is frozen. Every step folds the
  rank's own gradient into its momentum and takes a local step; every `H`-th step (`t % H == 0`,
  `H` = `local_step_interval`, doubling every `local_step_scaler` steps up to
  `local_step_clipper`) the ranks agree: the local updates since the last agreement, taken back
  and multiplied by the preconditioner `sqrt(v) + eps`, are averaged with the 1-bit all-reduce
  (`u`, the lr-weighted sum of the momenta); the momentum becomes `-u / sum(lr)` and the
  parameters move by `u / (sqrt(v) + eps)` from where they stood at the last agreement. The
  steps in between communicate nothing.

The update, as DeepSpeed's, has no bias correction: `p -= lr (m / (sqrt(v) + eps) + wd p)`.

At world size 1 nothing is communicated; the schedule (variance steps, momentum restarts at the
agreements) is the same.

State per parameter: `step`, `exp_avg`, `exp_avg_sq`, `momentum_accumulator` (the local updates
since the last agreement), `lrs` (the sum of their learning rates), and 1-bit Adam's
`worker_error`, `server_error`, `error_rank`, `error_world_size` (optim/onebit_adam.py).

Differences from DeepSpeed's ZeroOneAdam: docs/deepspeed-differences.md ("1-bit Adam").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from zeroshard.errors import ConfigError
from zeroshard.optim.onebit_adam import OneBitAdam

logger = logging.getLogger("zeroshard")


def variance_update_step(step: int, var_update_scaler: int) -> bool:
    """Whether step `step` (1-based) updates the variance (and all-reduces in full precision).

    DeepSpeed's rule: the interval starts at 1 and doubles after every `var_update_scaler`
    variance steps; a step is a variance step when it is a multiple of the current interval."""
    if step < 1:
        raise ValueError(f"variance_update_step: step {step} < 1")
    interval, last = 1, 0  # last: the final variance step of the previous interval
    while True:
        first = (last // interval + 1) * interval
        end = first + (var_update_scaler - 1) * interval
        if step <= end:
            return step >= first and step % interval == 0
        last, interval = end, interval * 2


def local_step_interval(step: int, var_freeze_step: int, local_step_scaler: int, local_step_clipper: int) -> int:
    """`H` at local-phase step `step` (> var_freeze_step): 1 for the first `local_step_scaler`
    steps of the phase, then doubling every `local_step_scaler` steps, at most
    `local_step_clipper`. The ranks agree at the steps with `step % H == 0`."""
    if step <= var_freeze_step:
        raise ValueError(f"local_step_interval: step {step} is in the variance phase (<= {var_freeze_step})")
    interval = 1
    for _ in range((step - var_freeze_step - 1) // local_step_scaler):
        if interval >= local_step_clipper:
            break
        interval = min(local_step_clipper, interval * 2)
    return interval


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"optimizer.params.{name}: got {value!r}, expected an int >= 1.")
    return value


class ZeroOneAdam(OneBitAdam):
    """0/1 Adam on the 1-bit all-reduce of `OneBitAdam` (whose wiring and checkpoint handling
    of the error buffers it reuses; its own `step`).

    Args:
        params: parameters or parameter groups (the engine's master parameters).
        lr, betas, eps, weight_decay: as Adam (decoupled weight decay), no bias correction.
        var_freeze_step: the last step that may update the variance.
        var_update_scaler: variance steps per interval before the interval doubles (kappa).
        local_step_scaler: local-phase steps per local interval before it doubles.
        local_step_clipper: the largest local interval (H).
        comm_backend_name, cuda_aware: as OneBitAdam.
    """

    def __init__(self, params: Iterable[Any], *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, var_freeze_step: int = 100000,
                 var_update_scaler: int = 16, local_step_scaler: int = 32678, local_step_clipper: int = 16,
                 comm_backend_name: str = "nccl", cuda_aware: bool = False) -> None:
        self.var_freeze_step = _positive_int("var_freeze_step", var_freeze_step)
        self.var_update_scaler = _positive_int("var_update_scaler", var_update_scaler)
        self.local_step_scaler = _positive_int("local_step_scaler", local_step_scaler)
        self.local_step_clipper = _positive_int("local_step_clipper", local_step_clipper)
        super().__init__(params, lr=lr, freeze_step=var_freeze_step, betas=betas, eps=eps,
                         weight_decay=weight_decay, comm_backend_name=comm_backend_name, cuda_aware=cuda_aware)

    def __repr__(self) -> str:
        return (f"ZeroOneAdam(var_freeze_step={self.var_freeze_step}, steps={self.steps_taken}, "
                f"{self._allreduce!r})")

    @property
    def compressing(self) -> bool:
        """True when the next step does not all-reduce the gradient in full precision."""
        return not self._full_step(self.steps_taken + 1)

    def _full_step(self, step: int) -> bool:
        return step <= self.var_freeze_step and variance_update_step(step, self.var_update_scaler)

    def syncs_at(self, step: int) -> bool:
        """Whether step `step` communicates at all (every variance-phase step does)."""
        if step <= self.var_freeze_step:
            return True
        interval = local_step_interval(step, self.var_freeze_step, self.local_step_scaler, self.local_step_clipper)
        return step % interval == 0

    def _average(self, tensors: list[Tensor]) -> list[Tensor]:
        """The 1-bit average over ranks (the tensors themselves at world size 1)."""
        if self._comm is None or self._comm.world_size == 1 or self._allreduce is None:
            return tensors
        averaged = self._allreduce.average([t.reshape(-1).float() for t in tensors])
        return [a.view_as(t) for a, t in zip(averaged, tensors)]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self._comm is None:
            raise RuntimeError("ZeroOneAdam.step() before attach(): build it through zeroshard.initialize() "
                               "(the config's optimizer section), which gives it the process group")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["momentum_accumulator"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["lrs"] = 0.0
        if "worker_error" not in self.state[params[0]]:
            self._bind_errors(reset=True)
        t = self.steps_taken + 1
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if t <= self.var_freeze_step:
            self._variance_phase_step(t, grads)
        else:
            if t == self.var_freeze_step + 1:
                logger.info(f"ZeroOneAdam: variance frozen after step {self.var_freeze_step}; local steps "
                            "from now on")
                assert self._allreduce is not None
                for e in self._allreduce.worker_errors + self._allreduce.server_errors_full:
                    e.zero_()  # the errors of compressed gradients do not apply to the accumulated updates
            self._local_phase_step(t, grads)
        for p in params:
            self.state[p]["step"] += 1
        self._strategy.set_grad_reduction(self._full_step(t + 1))
        return loss

    def _groups(self) -> Iterable[tuple[dict[str, Any], Tensor, int]]:
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                yield group, p, i
                i += 1

    def _apply(self, group: dict[str, Any], p: Tensor, denom: Tensor) -> Tensor:
        """`p -= lr (m / denom + wd p)`; returns the change."""
        update = self.state[p]["exp_avg"] / denom
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        update.mul_(-group["lr"])
        p.add_(update)
        return update

    def _variance_phase_step(self, t: int, grads: list[Tensor]) -> None:
        full = variance_update_step(t, self.var_update_scaler)
        if not full:
            grads = self._average(grads)
        for group, p, i in self._groups():
            beta1, beta2 = group["betas"]
            state, g = self.state[p], grads[i]
            if full:
                state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
            self._apply(group, p, state["exp_avg_sq"].sqrt().add_(group["eps"]))

    def _local_phase_step(self, t: int, grads: list[Tensor]) -> None:
        denoms = []
        for group, p, i in self._groups():
            state = self.state[p]
            state["exp_avg"].mul_(group["betas"][0]).add_(grads[i], alpha=1 - group["betas"][0])
            state["lrs"] += group["lr"]
            denom = state["exp_avg_sq"].sqrt().add_(group["eps"])
            state["momentum_accumulator"].add_(self._apply(group, p, denom))
            denoms.append(denom)
        if not self.syncs_at(t):
            return
        params = self._params()
        accs = [self.state[p]["momentum_accumulator"] for p in params]
        for p, acc, denom in zip(params, accs, denoms):
            p.sub_(acc)  # back to where the ranks last agreed
            acc.mul_(denom)  # the lr-weighted sum of the momenta (plus the decay), negated
        averaged = self._average(accs)
        for p, acc, avg, denom in zip(params, accs, averaged, denoms):
            state = self.state[p]
            state["exp_avg"].copy_(avg).div_(-state["lrs"])
            p.addcdiv_(avg, denom)
            acc.zero_()
            state["lrs"] = 0.0
