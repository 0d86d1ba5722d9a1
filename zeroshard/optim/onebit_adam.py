"""1-bit Adam (DeepSpeed's `OneBitAdam`, https://arxiv.org/abs/2102.02888): Adam whose momentum,
not its gradient, crosses the network, as signs, once the variance has settled.

Two stages, switched by the step count:

- *warm-up* (steps 1..`freeze_step`): plain AdamW. The strategy all-reduces full-precision
  gradients and this class runs torch's AdamW step unchanged (its fused kernel where
  `build_optimizer` would use it), so the trajectory is bitwise that of `"type": "Adam"`.
- *compression* (after `freeze_step`): the strategy stops reducing gradients
  (`Stage0Strategy.set_grad_reduction(False)`); each rank folds its local gradient into the
  momentum, `m = b1 m + (1 - b1) g_r`, and the momenta are averaged by the error-feedback 1-bit
  all-reduce of optim/onebit_allreduce.py (one scale per parameter, four collectives for all of them). The variance
  `exp_avg_sq` stays frozen at its step-`freeze_step` value; the update is AdamW's with that
  variance: `p -= lr (m / bc1) / (sqrt(v / bc2_freeze) + eps) + lr wd p`, where `bc1 = 1 - b1^t`
  keeps counting and `bc2_freeze = 1 - b2^freeze_step`.

At world size 1 nothing is communicated (DeepSpeed skips the compressed all-reduce there too),
so the compression stage is Adam with a frozen variance.

State per parameter: torch AdamW's `step`, `exp_avg`, `exp_avg_sq`, plus `worker_error` and
`server_error` (views into the all-reduce's flat errors, saved and restored by checkpoints) and
`error_rank` / `error_world_size` (whose errors they are: a load on another rank or world size
starts them at zero, as DeepSpeed always does).

Differences from DeepSpeed's OnebitAdam: docs/deepspeed-differences.md ("1-bit Adam").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from zeroshard.errors import ConfigError
from zeroshard.optim.onebit_allreduce import SignAllReduce

if TYPE_CHECKING:
    from zeroshard.comm import Comm

logger = logging.getLogger("zeroshard")

ERROR_KEYS = ("worker_error", "server_error")
"""Elementwise state that belongs to the 1-bit all-reduce of one rank."""

OWNER_KEYS = ("error_rank", "error_world_size")
"""Who the errors belong to; a load elsewhere starts them at zero."""

LOCAL_STEP_KEYS = ("momentum_accumulator", "lrs")
"""0/1 Adam's (optim/zero_one_adam.py) local-step state: the updates since the ranks last agreed."""

COMM_BACKENDS = ("nccl", "gloo")
"""`comm_backend_name` values accepted: both name the job's own process group (see `attach`)."""


LAMB_STATE_KEYS = ("exp_avg_sq_fresh", "lamb_coeff_freeze", "last_factor", "scaling_coeff")
"""1-bit Lamb's state beyond Lamb's (optim/onebit_lamb.py)."""

STATE_KEYS = ERROR_KEYS + OWNER_KEYS + LOCAL_STEP_KEYS + LAMB_STATE_KEYS
"""State keys the 1-bit optimizers add to Adam's and Lamb's; a plain optimizer loading their
checkpoint drops them."""


def check_onebit_args(freeze_step: Any, comm_backend_name: str, cuda_aware: bool, key: str = "freeze_step") -> None:
    """The arguments every 1-bit optimizer shares, refused by name when they cannot be honoured."""
    if not isinstance(freeze_step, int) or isinstance(freeze_step, bool) or freeze_step < 1:
        raise ConfigError(f"optimizer.params.{key}: got {freeze_step!r}, expected an int >= 1 "
                          "(the number of full-precision warm-up steps).")
    if comm_backend_name not in COMM_BACKENDS:
        raise ConfigError(
            f"optimizer.params.comm_backend_name: {comm_backend_name!r} is not supported; zeroshard runs "
            f"the compressed all-reduce on the job's process group: use one of {list(COMM_BACKENDS)} "
            "(both mean that group: NCCL on CUDA, gloo on CPU). DeepSpeed's 'mpi' and 'hccl' paths "
            "are not provided.")
    if cuda_aware:
        raise ConfigError("optimizer.params.cuda_aware: true asks for DeepSpeed's CUDA-aware MPI path, "
                          "which zeroshard does not provide (torch process groups move device tensors "
                          "directly). Remove it or set it to false.")


class OneBitOptimizer:
    """What the 1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb) share, mixed into a
    `torch.optim.Optimizer`: the process group and strategy (`attach`), the 1-bit all-reduce with
    its error buffers kept as per-parameter state, the warm-up/compression switch, and the
    rebinding of the errors after a checkpoint load."""

    freeze_step: int
    comm_backend_name: str
    param_groups: list[dict[str, Any]]
    state: Any

    def _init_onebit(self, freeze_step: int, comm_backend_name: str) -> None:
        self.freeze_step = freeze_step
        self.comm_backend_name = comm_backend_name
        self._comm: "Comm | None" = None
        self._strategy: Any = None
        self._allreduce: SignAllReduce | None = None

    def attach(self, comm: "Comm", strategy: Any) -> None:
        """Give the optimizer its process group and the strategy whose gradient reduction it
        switches off after the warm-up.

        Raises:
            ConfigError: the strategy cannot hand out local gradients (a ZeRO stage above 0).
        """
        name = type(self).__name__
        if not strategy.keeps_local_grads():
            raise ConfigError(f"optimizer.type {name} needs zero_optimization.stage 0 (plain data "
                              f"parallelism, as in DeepSpeed); {type(strategy).__name__} partitions the "
                              "gradients. Set stage to 0 or use Adam.")
        backend = comm.groups.backend
        if self.comm_backend_name != backend and comm.world_size > 1:
            logger.info(f"{name}: comm_backend_name {self.comm_backend_name!r} maps to the job's "
                        f"{backend} process group")
        self._comm, self._strategy = comm, strategy
        device = self._params()[0].device if self._params() else torch.device("cpu")
        self._allreduce = SignAllReduce([p.numel() for p in self._params()], comm, device)
        strategy.set_grad_reduction(not self.compressing)

    def _params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _bind_errors(self, reset: bool) -> None:
        """Point each parameter's error state at its slice of the all-reduce's flat errors.

        Done after the optimizer created its state (the first step, or a load): torch's
        optimizers initialise a parameter's state only while it is empty."""
        ar, comm = self._allreduce, self._comm
        if ar is None or comm is None:
            return
        for i, p in enumerate(self._params()):
            state = self.state[p]
            for key, errors in (("worker_error", ar.worker_errors), ("server_error", ar.server_errors_full)):
                view = errors[i].view(p.shape)
                if reset:
                    view.zero_()
                elif key in state and state[key] is not view:
                    view.copy_(state[key])
                state[key] = view
            state["error_rank"], state["error_world_size"] = comm.rank, comm.world_size

    @property
    def steps_taken(self) -> int:
        """Optimizer steps applied so far (the per-parameter `step`, the same for all)."""
        for p in self._params():
            step = self.state.get(p, {}).get("step")
            if step is not None:
                return int(step)
        return 0

    @property
    def compressing(self) -> bool:
        """True once the warm-up is over: the next step averages the momentum in 1 bit."""
        return self.steps_taken >= self.freeze_step

    def _check_attached(self) -> None:
        if self._comm is None:
            raise RuntimeError(f"{type(self).__name__}.step() before attach(): build it through "
                               "zeroshard.initialize() (the config's optimizer section), which gives it the "
                               "process group")

    def _after_warmup_step(self, what: str) -> None:
        """After a warm-up step: bind the errors once the state exists; at the warm-up's end,
        switch the strategy's full-precision gradient reduction off."""
        if "worker_error" not in self.state.get(self._params()[0], {}):
            self._bind_errors(reset=True)
        if self.compressing:
            logger.info(f"{type(self).__name__}: warm-up over after {self.freeze_step} steps; the momentum is "
                        f"now averaged with 1-bit compression and {what} frozen")
            self._strategy.set_grad_reduction(False)

    def _average_momenta(self, momenta: list[Tensor]) -> None:
        """Replace each rank's momenta by their 1-bit average over ranks (nothing at world 1)."""
        if self._comm is not None and self._comm.world_size > 1 and self._allreduce is not None:
            averaged = self._allreduce.average([m.reshape(-1).float() for m in momenta])
            torch._foreach_copy_(momenta, [a.view_as(m) for a, m in zip(averaged, momenta)])

    def _rebind_after_load(self) -> None:
        """After the optimizer's own `load_state_dict`: restore the errors when they are this
        rank's (same rank and world size), else start them at zero; set the strategy's gradient
        reduction for the stage the loaded step count is in."""
        comm = self._comm
        if comm is None:
            return
        states = [self.state.get(p, {}) for p in self._params()]
        if not any("step" in s for s in states):
            return  # saved before the first step: nothing to bind yet
        own = all(s.get("error_rank") == comm.rank and s.get("error_world_size") == comm.world_size
                  and all(k in s for k in ERROR_KEYS) for s in states)
        if not own:
            logger.info(f"{type(self).__name__}: the checkpoint holds no 1-bit errors of this rank at this world "
                        "size; they start at zero (DeepSpeed always resets them on load)")
        self._bind_errors(reset=not own)
        if self._strategy is not None:
            self._strategy.set_grad_reduction(not self.compressing)


class OneBitAdam(OneBitOptimizer, torch.optim.AdamW):
    """AdamW with a full-precision warm-up, then 1-bit compressed momentum averaging.

    Args:
        params: parameters or parameter groups (the engine's master parameters).
        lr, betas, eps, weight_decay: as torch's AdamW (decoupled weight decay, DeepSpeed's
            default of 0 for weight decay).
        freeze_step: steps of warm-up; compression starts at step `freeze_step + 1`.
        comm_backend_name: "nccl" or "gloo": the compressed all-reduce runs on the engine's
            data-parallel group whatever its backend (gloo on CPU, NCCL on CUDA).
        cuda_aware: DeepSpeed's MPI-backend switch; only false (there is no MPI path).
        fused: passed to AdamW for the warm-up steps.

    The engine calls `attach(comm, strategy)` before the first step (runtime/initialize.py).
    """

    def __init__(self, params: Iterable[Any], *, lr: float = 1e-3, freeze_step: int = 100000,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 comm_backend_name: str = "nccl", cuda_aware: bool = False, fused: bool | None = None) -> None:
        check_onebit_args(freeze_step, comm_backend_name, cuda_aware)
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, fused=fused)
        self._init_onebit(freeze_step, comm_backend_name)

    def __repr__(self) -> str:
        return (f"OneBitAdam(freeze_step={self.freeze_step}, steps={self.steps_taken}, "
                f"{'compressing' if self.compressing else 'warm-up'}, {self._allreduce!r})")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self._check_attached()
        if not self.compressing:
            loss = super().step(closure)
            self._after_warmup_step("the variance is")
            return loss
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._compressed_step()
        return loss

    def _compressed_step(self) -> None:
        momenta = []
        for group in self.param_groups:
            beta1 = group["betas"][0]
            for p in group["params"]:
                exp_avg = self.state[p]["exp_avg"]
                if p.grad is not None:  # a parameter without a gradient keeps its momentum
                    exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                momenta.append(exp_avg)
        self._average_momenta(momenta)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            bc2 = 1 - beta2 ** self.freeze_step
            for p in group["params"]:
                state = self.state[p]
                state["step"] += 1
                bc1 = 1 - beta1 ** float(state["step"])
                if wd:
                    p.mul_(1 - lr * wd)
                denom = (state["exp_avg_sq"].sqrt() / bc2 ** 0.5).add_(eps)
                p.addcdiv_(state["exp_avg"], denom, value=-lr / bc1)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load AdamW's state; restore the errors when they are this rank's (same rank and world
        size), else start them at zero. A plain Adam checkpoint loads too (errors at zero)."""
        super().load_state_dict(state_dict)
        self._rebind_after_load()


def drop_onebit_state(state: dict[str, Any]) -> dict[str, Any]:
    """A fragment's saved state without 1-bit Adam's keys (loading into a plain optimizer)."""
    return {k: v for k, v in state.items() if k not in STATE_KEYS}
