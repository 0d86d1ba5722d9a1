"""fp16 loss scaling: a static scale, or DeepSpeed's dynamic scale with hysteresis.

The scaler only keeps the scale; the engine multiplies the loss by ``loss_scale``, checks the
global gradient norm for inf/nan, skips the step on overflow (on every rank, and without
stepping the lr scheduler) and then calls ``update(overflow)`` once per optimizer step.
Imports only zeroshard.errors.
"""

from __future__ import annotations

import abc
import logging
import math
from collections.abc import Mapping
from typing import Any

from zeroshard.errors import ConfigError, ZeroshardError

logger = logging.getLogger("zeroshard")


class LossScaleError(ZeroshardError, RuntimeError):
    """Gradients overflowed while the dynamic loss scale was already at its minimum."""


class LossScaler(abc.ABC):
    """The engine's view of a loss scaler."""

    @property
    @abc.abstractmethod
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before backward."""

    @property
    def dynamic(self) -> bool:
        """Whether ``update`` can change the scale."""
        return False

    @abc.abstractmethod
    def update(self, overflow: bool) -> None:
        """Record the outcome of one optimizer step (``overflow``: its gradients had inf/nan)."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The scaler's mutable state, for checkpoints."""

    @abc.abstractmethod
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


class StaticLossScaler(LossScaler):
    """A fixed scale (``fp16.loss_scale > 0``). An overflow still makes the engine skip the step.

    Args:
        scale: the loss scale, a positive finite number.

    Example:
        >>> scaler = StaticLossScaler(128.0)
        >>> scaler.update(overflow=True); scaler.loss_scale
        128.0
    """

    def __init__(self, scale: float = 1.0) -> None:
        if not (math.isfinite(scale) and scale > 0):
            raise ConfigError(f"fp16.loss_scale: got {scale!r}, expected a positive finite number (0 = dynamic)")
        self._scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self._scale

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's name for the scale (its `LossScaler.cur_scale`)."""
        return self._scale

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self._scale}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        # A static scale comes from the config, not the checkpoint: a resumed run that changed
        # fp16.loss_scale gets the new value.
        pass


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scale (``DynamicLossScaler.update_scale``), step for step.

    - Overflow: if the hysteresis countdown is at 1 (or ``hysteresis == 1``) the scale drops to
      ``max(scale / scale_factor, min_scale)``; otherwise the countdown drops by one and the scale
      stays. The countdown is not refilled by lowering, so after the first drop every further
      overflow lowers the scale until it is refilled.
    - No overflow: with ``consecutive_hysteresis`` the countdown is refilled at once. The scale is
      multiplied by ``scale_factor`` when the number of clean steps since the last overflow (or
      since the start) is a positive multiple of ``scale_window``, counted *before* this step: the
      first raise comes on the ``scale_window + 1``-th clean step. Without
      ``consecutive_hysteresis``, a raise also refills the countdown.
    - Overflow with the scale already at ``min_scale``: the scale stays there, or, when
      ``raise_error_at_min_scale``, ``LossScaleError`` is raised.

    Args:
        init_scale: starting scale (``2 ** fp16.initial_scale_power``).
        scale_factor: the factor of each lowering and raise (DeepSpeed fixes it at 2).
        scale_window: clean steps between raises (``fp16.loss_scale_window``).
        min_scale: the floor (``fp16.min_loss_scale``).
        hysteresis: overflows needed before the first lowering (``fp16.hysteresis``).
        consecutive_hysteresis: refill the countdown on every clean step.
        raise_error_at_min_scale: raise instead of staying at ``min_scale``.

    Example:
        >>> scaler = DynamicLossScaler(init_scale=2**16, hysteresis=2)
        >>> scaler.update(True); scaler.loss_scale   # countdown 2 -> 1, scale kept
        65536.0
        >>> scaler.update(True); scaler.loss_scale   # lowered
        32768.0
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = False,
    ) -> None:
        _check(math.isfinite(init_scale) and init_scale > 0, "fp16.initial_scale_power", init_scale,
               "a finite positive initial scale")
        _check(scale_factor > 1, "scale_factor", scale_factor, "a factor > 1")
        _check(isinstance(scale_window, int) and scale_window >= 1, "fp16.loss_scale_window", scale_window,
               "an integer >= 1")
        _check(math.isfinite(min_scale) and 0 < min_scale <= init_scale, "fp16.min_loss_scale", min_scale,
               f"a positive number <= the initial scale ({init_scale:g})")
        _check(isinstance(hysteresis, int) and hysteresis >= 1, "fp16.hysteresis", hysteresis, "an integer >= 1")
        self.scale_factor = float(scale_factor)
        self.scale_window = scale_window
        self.min_scale = float(min_scale)
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        # Mutable state (all of it goes into state_dict).
        self.cur_scale = float(init_scale)
        self.cur_iter = 0  # update() calls so far
        self.last_overflow_iter = -1  # cur_iter of the last overflow; -1 = "just before the start"
        self.cur_hysteresis = hysteresis  # overflows left before the next lowering

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    @property
    def dynamic(self) -> bool:
        return True

    @property
    def delayed_shift(self) -> int:
        """DeepSpeed's name for ``hysteresis`` (its `DynamicLossScaler.delayed_shift`)."""
        return self.hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            self._on_overflow()
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            clean_steps = self.cur_iter - self.last_overflow_iter - 1
            if clean_steps > 0 and clean_steps % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.hysteresis == 1 or self.cur_hysteresis == 1:
            if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                raise LossScaleError(
                    f"fp16 gradients overflowed at update {self.cur_iter} with the loss scale already at "
                    f"fp16.min_loss_scale ({self.min_scale:g}). Check the loss and inputs for inf/nan, lower "
                    "min_loss_scale, or train in bf16; set raise_error_at_min_scale to false to keep going "
                    "(skipping the overflowing steps)."
                )
            new_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            logger.info("fp16 overflow: skipping step, loss scale %g -> %g", self.cur_scale, new_scale)
            self.cur_scale = new_scale
        else:
            logger.info("fp16 overflow: skipping step, loss scale %g kept (hysteresis %d -> %d)",
                        self.cur_scale, self.cur_hysteresis, self.cur_hysteresis - 1)
            self.cur_hysteresis -= 1
        self.last_overflow_iter = self.cur_iter

    def state_dict(self) -> dict[str, Any]:
        """``cur_scale``, ``cur_iter``, ``last_overflow_iter`` (DeepSpeed's names) and
        ``cur_hysteresis`` (which DeepSpeed does not save: it refills on resume)."""
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.cur_scale = float(state_dict["cur_scale"])
        self.cur_iter = int(state_dict["cur_iter"])
        self.last_overflow_iter = int(state_dict["last_overflow_iter"])
        self.cur_hysteresis = int(state_dict.get("cur_hysteresis", self.hysteresis))


def _check(ok: bool, key: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: got {value!r}, expected {expected}.")


def build_loss_scaler(
    *,
    loss_scale: float,
    initial_scale_power: int,
    loss_scale_window: int,
    hysteresis: int,
    consecutive_hysteresis: bool,
    min_loss_scale: float,
    raise_error_at_min_scale: bool = False,
) -> LossScaler:
    """Map the ``fp16`` config section to a scaler: ``loss_scale == 0`` means dynamic, starting
    at ``2 ** initial_scale_power``; any other value is a static scale.

    Raises:
        ConfigError: a value out of range, naming its ``fp16.*`` key.
    """
    if loss_scale == 0:
        return DynamicLossScaler(
            init_scale=2.0**initial_scale_power,
            scale_window=loss_scale_window,
            min_scale=min_loss_scale,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            raise_error_at_min_scale=raise_error_at_min_scale,
        )
    return StaticLossScaler(loss_scale)
