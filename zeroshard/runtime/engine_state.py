"""Where the engine stands in a micro-batch: one `Phase` (FSDP2's `TrainingState` is the model),
the count of backward passes since the last optimizer step, and the user's two boundary requests.

`ZeroEngine` (runtime/engine.py) owns one `MicroBatchState` and moves it through the phases;
this module only records and answers, it raises nothing and imports nothing of zeroshard.

Note: [micro-batch phases] One micro-batch goes

    IDLE --forward (training)--> FORWARD --engine.scale(loss)--> SCALED
         --backward starts--> BACKWARD | BACKWARD_AT_BOUNDARY --ends--> IDLE | REDUCED
         --step() at the boundary--> IDLE

`FORWARD` and `SCALED` are "a training forward awaits its backward" (step() refuses);
`SCALED` also lets a direct `loss.backward()` run under fp16 loss scaling (runtime/
direct_backward.py). `REDUCED` is "reduced gradients wait for step()" (safe_get_full_grad and
friends read them). An evaluation forward (no grad, or module.eval()) drops a pending `FORWARD`
back to `IDLE` (its output was not meant for a backward) and leaves `SCALED` (a scaled loss
still awaits its backward) and `REDUCED` alone; a training forward after `REDUCED` starts the
next micro-batch (`FORWARD`). `no_sync` and
`set_gradient_accumulation_boundary` are the user's requests that decide whether a backward
reduces; they span micro-batches, so they are fields beside the phase, not phases. Under
`managed_gradient_accumulation: false` no backward reduces: `step()` reduces what accumulated
(BACKWARD ... BACKWARD, then REDUCED inside step()) and steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto


class Phase(Enum):
    """The engine's position in a micro-batch (Note: [micro-batch phases])."""

    IDLE = auto()
    """No training forward awaits a backward; no reduced gradients wait for step()."""
    FORWARD = auto()
    """A training forward's output awaits its backward."""
    SCALED = auto()
    """As FORWARD, and `engine.scale(loss)` scaled a loss for a direct backward."""
    BACKWARD = auto()
    """A backward pass runs that only accumulates gradients."""
    BACKWARD_AT_BOUNDARY = auto()
    """A backward pass runs that reduces the gradients (the step's last micro-batch)."""
    REDUCED = auto()
    """The boundary backward finished: reduced gradients wait for step()."""


@dataclass(slots=True)
class MicroBatchState:
    """The engine's micro-batch state in one object (replaces seven loose flags)."""

    phase: Phase = Phase.IDLE
    pending_backwards: int = 0
    """Backward passes since the last optimizer step (a checkpoint refuses to save between)."""
    boundary_override: bool | None = None
    """`set_gradient_accumulation_boundary`'s value; None follows the micro-step count."""
    no_sync: bool = False
    """Inside `engine.no_sync()`: backward passes only accumulate."""
    managed: bool = True
    """`managed_gradient_accumulation`: False makes every `step()` the boundary (the script owns it)."""
    stepping: bool = False
    """Inside `engine.step()` (the boundary when not `managed`, as DeepSpeed's `_running_engine_step`)."""

    def is_boundary(self, micro_steps: int, grad_accum_steps: int) -> bool:
        """The current micro-batch is the last of its step (DeepSpeed's question). Not `managed`:
        only while `step()` runs, so a backward never reduces."""
        if not self.managed:
            return self.stepping
        if self.boundary_override is not None:
            return self.boundary_override
        return (micro_steps + 1) % grad_accum_steps == 0

    def reduces(self, micro_steps: int, grad_accum_steps: int) -> bool:
        """A backward now reduces: at the boundary and outside `no_sync`."""
        return self.is_boundary(micro_steps, grad_accum_steps) and not self.no_sync

    @property
    def awaits_backward(self) -> bool:
        return self.phase in (Phase.FORWARD, Phase.SCALED)

    @property
    def grads_ready(self) -> bool:
        return self.phase is Phase.REDUCED

    def forward(self, training: bool) -> None:
        """A forward ran; `training`: with grad enabled and the module in train mode."""
        if training:
            if self.phase is not Phase.SCALED:
                self.phase = Phase.FORWARD
        elif self.phase is Phase.FORWARD:
            self.phase = Phase.IDLE

    def scaled(self) -> None:
        self.phase = Phase.SCALED

    def begin_backward(self, reduces: bool) -> None:
        self.phase = Phase.BACKWARD_AT_BOUNDARY if reduces else Phase.BACKWARD

    def end_backward(self) -> None:
        self.phase = Phase.REDUCED if self.phase is Phase.BACKWARD_AT_BOUNDARY else Phase.IDLE
        self.pending_backwards += 1

    def batch_reduced(self, micro_batches: int) -> None:
        """A pipeline batch's backward passes ran and its gradients were reduced (the pipeline
        driver hands them to the strategy at once): reduced gradients wait for the step."""
        self.phase = Phase.REDUCED
        self.pending_backwards += micro_batches

    def stepped(self) -> None:
        """The optimizer step ran, or a checkpoint load replaced every state: no gradients wait
        (a training forward awaiting its backward still does)."""
        if not self.awaits_backward:
            self.phase = Phase.IDLE
        self.pending_backwards = 0
