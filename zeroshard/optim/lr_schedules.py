"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
LRRangeTest): same parameter names, defaults, formulas and stepping. Imports only zeroshard.errors.

Stepping (as in DeepSpeed): the engine calls ``step()`` once per optimizer step that was applied
(never on a skipped fp16 overflow step), *after* ``optimizer.step()``. ``last_batch_iteration``
counts those calls, starting at -1; the lr a schedule sets is the lr of the *next* optimizer step.
Construction sets each group's lr to the schedule's value at ``last_batch_iteration`` (for -1: the
warmup/cycle minimum, or 0 for WarmupCosineLR), so the first optimizer step uses that value
(DeepSpeed leaves the lr alone when resuming with last_batch_iteration >= 0; we set it).
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol

import torch

from zeroshard.errors import ConfigError

logger = logging.getLogger("zeroshard")

WarmupType = Literal["log", "linear"]
_WARMUP_TYPES = ("log", "linear")


class Scheduler(Protocol):
    """What the engine needs from any schedule (ours or a ``torch.optim.lr_scheduler`` one)."""
    def step(self) -> None: ...
    def get_last_lr(self) -> list[float]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _per_group(value: float | Sequence[float], n_groups: int, name: str) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != n_groups:
            raise ConfigError(f"{name}: got {len(value)} values, expected one per parameter group ({n_groups})")
        return [float(v) for v in value]
    return [float(value)] * n_groups  # type: ignore[arg-type]


def _hint(word: str, choices: Iterable[str]) -> str:
    near = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.5)
    return f' Did you mean "{near[0]}"?' if near else ""


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> int:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ConfigError(f"warmup_num_steps: got {warmup_num_steps!r}, expected a positive integer")
    if warmup_type not in _WARMUP_TYPES:
        hint = _hint(warmup_type, _WARMUP_TYPES)
        raise ConfigError(f"warmup_type: got {warmup_type!r}, expected 'log' or 'linear'.{hint}")
    # DeepSpeed clamps to 2 so that log(warmup_num_steps) is never 0.
    return max(2, warmup_num_steps)


def _check_total(schedule: object, total_num_steps: int, warmup_num_steps: int) -> None:
    if total_num_steps < warmup_num_steps:  # DeepSpeed warns too; the schedule is still defined
        logger.warning("%s: total_num_steps %d < warmup_num_steps %d", type(schedule).__name__,
                       total_num_steps, warmup_num_steps)


def _warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done after ``iteration`` steps: log(it+1)/log(W) or it/W."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


class LRSchedule:
    """Base of the DeepSpeed schedules: owns ``last_batch_iteration`` and writes group lrs.

    Subclasses implement ``get_lr()`` (the lrs for the current ``last_batch_iteration``).
    Works with any optimizer exposing torch-style ``param_groups``; a tensor ``lr`` is
    updated in place so a captured/compiled step keeps seeing the same tensor.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        if not getattr(optimizer, "param_groups", None):
            raise ConfigError(f"{type(self).__name__}: the optimizer has no param_groups")
        self.optimizer = optimizer
        self.last_batch_iteration = int(last_batch_iteration)
        self._last_lr: list[float] = []

    def get_lr(self) -> list[float]:
        raise NotImplementedError(f"{type(self).__name__}.get_lr")

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = list(lrs)

    def get_last_lr(self) -> list[float]:
        """The lrs most recently written to the optimizer (one per parameter group)."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the current one + 1) and set the lrs."""
        it = self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        self.last_batch_iteration = int(it)
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """DeepSpeed's layout: ``{"last_batch_iteration": int}``."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the position and re-apply its lrs (DeepSpeed waits for the next ``step()``)."""
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])
        self._apply()


class WarmupLR(LRSchedule):
    """Warm each group's lr up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    After step ``it``: ``min + (max - min) * g(it)`` with ``g = log(it+1)/log(W)`` ("log") or
    ``it/W`` ("linear") while ``it < W`` (``W = max(2, warmup_num_steps)``), else ``g = 1``.
    Before the first step (``it = -1``) the lr is ``warmup_min_lr``; so is the lr after step 0.
    ``warmup_min_lr == warmup_max_lr`` gives a constant lr.

    Args: ``optimizer`` (anything with torch-style ``param_groups``); ``warmup_min_lr`` and
    ``warmup_max_lr``, each a float or one per group (``warmup_max_lr=None``, DeepSpeed's code
    default, takes each group's current lr); ``warmup_num_steps`` (a positive int);
    ``warmup_type`` ("log" | "linear"); ``last_batch_iteration`` (-1 starts the schedule).
    Raises ``ConfigError`` on a bad ``warmup_type`` / ``warmup_num_steps`` / per-group list.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
        warmup_type: WarmupType = "log", last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        n = len(optimizer.param_groups)
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in optimizer.param_groups]
        self.min_lrs = _per_group(warmup_min_lr, n, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, n, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self._apply()

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        return [lo + d * self._gamma() for lo, d in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay back to ``warmup_min_lr`` at ``total_num_steps``.

    After warmup (``it >= W``): ``g = max(0, (total_num_steps - it) / max(1, total_num_steps - W))``,
    so the lr is ``warmup_max_lr`` at ``it = W``, ``warmup_min_lr`` at and past ``total_num_steps``.
    Note DeepSpeed's default ``warmup_max_lr`` here is 0.001 (not the optimizer's lr).
    Other arguments as in ``WarmupLR``.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001, warmup_num_steps: int = 1000,
        warmup_type: WarmupType = "log", last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        _check_total(self, self.total_num_steps, self.warmup_num_steps)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(LRSchedule):
    """Scale each group's lr (as set when the schedule is built) by a warmup-then-cosine ratio.

    Ratio after step ``it``: warmup ``r0 + (1 - r0) * g(it)`` for ``it < W`` (``g`` as in
    WarmupLR, ``r0 = warmup_min_ratio``); then ``c + (1 - c) * (1 + cos(pi * p)) / 2`` with
    ``p = min(1, (it - W + 1) / max(1, total_num_steps - W))`` and ``c = cos_min_ratio``, so it
    stays at ``c`` past ``total_num_steps`` (current DeepSpeed; 0.19.0 let the cosine rise again).
    Before the first step the ratio is 0, not ``r0`` (DeepSpeed): the first optimizer step uses lr 0.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: WarmupType = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        _check_total(self, self.total_num_steps, self.warmup_num_steps)
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self._apply()

    def get_lr_ratio(self) -> float:
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            frac = _warmup_fraction(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + frac * (1.0 - self.warmup_min_ratio)
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (it - self.warmup_num_steps + 1) / span)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        return [lr * self.get_lr_ratio() for lr in self.org_lrs]


class OneCycle(LRSchedule):
    """1Cycle: lr rises from ``cycle_min_lr`` to ``cycle_max_lr`` over ``cycle_first_step_size``
    steps, falls back over ``cycle_second_step_size`` (default: the first), then decays.

    With ``b = last_batch_iteration + 1`` inside the cycle (``last_batch_iteration < total``):
    scale ``s = b / first`` on the way up, ``(total - b) / second`` on the way down (a stair count
    ``k > 0`` floors ``s`` to multiples of ``1/k``); ``lr = min + (max - min) * s``. After the
    cycle: ``lr = cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size)`` with
    ``d = last_batch_iteration - total + 1`` (no decay when either is 0: lr stays at the minimum).

    Momentum (``cycle_momentum``) moves inversely: ``cycle_max_mom - (max - min) * s`` in the
    cycle, then ``cycle_max_mom * (1 + decay_mom_rate * d / decay_step_size)``. As DeepSpeed
    defines OneCycle, each group's ``betas`` becomes ``(momentum, 0.99)``: beta2 is 0.99 for the
    whole run whatever the optimizer was built with (see docs/deepspeed-differences.md, "OneCycle
    momentum"). Optimizers without ``betas`` in their defaults (SGD, Adagrad) keep their momentum:
    cycling is disabled with a warning, as in DeepSpeed. At construction lr = ``cycle_min_lr`` and
    betas = ``(cycle_min_mom, 0.99)`` (DeepSpeed's "initial" values).
    """

    BETA2 = 0.99
    """The second Adam coefficient DeepSpeed's OneCycle writes into every group (fixed)."""

    def __init__(  # DeepSpeed's parameters, in DeepSpeed's order
        self, optimizer: torch.optim.Optimizer, cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float], decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None, decay_step_size: int = 0, cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8, cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        n = len(optimizer.param_groups)
        second = cycle_first_step_size if cycle_second_step_size is None else cycle_second_step_size
        if cycle_first_step_size <= 0 or second < 0:
            raise ConfigError(f"cycle_first_step_size, cycle_second_step_size: got {cycle_first_step_size}, "
                              f"{second}; expected a positive first half and a second half >= 0 (0: the lr "
                              "rises over the whole cycle)")
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = float(second)
        self.total_size = self.first_step_size + self.second_step_size
        self.first_stair_count = int(cycle_first_stair_count)
        self.second_stair_count = int(cycle_first_stair_count if cycle_second_stair_count is None
                                      else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(cycle_min_lr, n, "cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, n, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.min_moms = _per_group(cycle_min_mom, n, "cycle_min_mom")
        self.max_moms = _per_group(cycle_max_mom, n, "cycle_max_mom")
        self.decay_mom_rate = float(decay_mom_rate)
        self._momentum_key = self._find_momentum_key(optimizer) if cycle_momentum else None
        self.cycle_momentum = self._momentum_key is not None
        self._apply()

    @staticmethod
    def _find_momentum_key(optimizer: torch.optim.Optimizer) -> str | None:
        # DeepSpeed cycles only `betas` (looked up in optimizer.defaults); SGD's `momentum` is left alone.
        if "betas" in getattr(optimizer, "defaults", {}) or "betas" in optimizer.param_groups[0]:
            return "betas"
        name = type(optimizer).__name__
        warnings.warn(f"OneCycle: cycle_momentum disabled: {name} has no 'betas' (DeepSpeed's OneCycle "
                      "cycles Adam-style betas only)", stacklevel=3)
        return None

    def _scale(self) -> float:
        b = self.last_batch_iteration + 1
        cycle = math.floor(1 + b / self.total_size)
        x = 1.0 + b / self.total_size - cycle
        ratio = self.first_step_size / self.total_size
        scale = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
        # Stairs: quantise from the integer offset into the cycle, not from `scale`, whose float
        # value at a half-cycle boundary can land just below an exact stair.
        offset = b % self.total_size
        rising = offset <= self.first_step_size
        stairs = self.first_stair_count if rising else self.second_stair_count
        if stairs > 0:
            position = offset / self.first_step_size if rising else (self.total_size - offset) / self.second_step_size
            scale = math.floor(position * stairs) / stairs
        return scale

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        if self.last_batch_iteration < self.total_size:
            return [lo + (hi - lo) * self._scale() for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0):
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    @property
    def step_ratio(self) -> float:
        """The rising half's share of the cycle (1.0 with a zero second half)."""
        return self.first_step_size / self.total_size

    def _moms(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_moms)
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0):
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * self._decay_interval()
        return [hi * factor for hi in self.max_moms]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """Each group's ``betas`` for the current position, ``(momentum, 0.99)`` (DeepSpeed's
        shape); None if momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        return [(m, self.BETA2) for m in self._moms()]

    def _apply(self) -> None:
        super()._apply()
        moms, key = self.get_mom(), self._momentum_key
        if moms is None or key is None:
            return
        for group, betas in zip(self.optimizer.param_groups, moms):
            group[key] = betas


class LRRangeTest(LRSchedule):
    """LR range test: after step ``it``, ``lr = lr_range_test_min_lr * (1 + rate * i)`` with
    ``i = (it + 1) / lr_range_test_step_size``, floored when ``lr_range_test_staircase``."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False, last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if lr_range_test_step_size <= 0:
            raise ConfigError(f"lr_range_test_step_size: got {lr_range_test_step_size}, expected a positive int")
        self.min_lrs = _per_group(lr_range_test_min_lr, len(optimizer.param_groups), "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        self._apply()

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        interval = math.floor(interval) if self.staircase else interval
        return [lr * (1.0 + self.step_rate * interval) for lr in self.min_lrs]


LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
"""DeepSpeed's names for its schedules (`deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`)."""

SCHEDULERS: dict[str, type[LRSchedule]] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}


def _torch_scheduler(name: str) -> type | None:
    cls = getattr(torch.optim.lr_scheduler, name, None)
    ok = inspect.isclass(cls) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler)
    return cls if ok else None


def build_scheduler(name: str, optimizer: torch.optim.Optimizer, params: Mapping[str, Any]) -> Scheduler:
    """Build the schedule ``name`` (a DeepSpeed schedule, else a ``torch.optim.lr_scheduler``
    class, as DeepSpeed's engine does) with ``params`` as keyword arguments.

    Raises:
        ConfigError: unknown ``name`` or parameter, naming ``scheduler.type`` / ``scheduler.params.*``.
    """
    cls: type | None = SCHEDULERS.get(name) or _torch_scheduler(name)
    if cls is None:
        raise ConfigError(
            f"scheduler.type: got {name!r}, expected one of {', '.join(SCHEDULERS)} "
            f"or a torch.optim.lr_scheduler class.{_hint(name, SCHEDULERS)}"
        )
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    signature = {k: p for k, p in inspect.signature(cls).parameters.items() if p.kind in kinds}
    accepted = [p for p in signature if p != "optimizer"]
    for key in params:
        if key not in accepted:
            raise ConfigError(f"scheduler.params.{key}: unknown parameter of {name}.{_hint(key, accepted)}")
    for key in accepted:
        if signature[key].default is inspect.Parameter.empty and key not in params:
            raise ConfigError(f"scheduler.params.{key}: required by {name}; add it to scheduler.params.")
    try:
        return cls(optimizer, **params)  # type: ignore[no-any-return]
    except ConfigError as err:
        raise ConfigError(f"scheduler.params.{err}") from None
