"""Exception hierarchy. Every error zeroshard raises on purpose derives from ZeroshardError. Also
the exit status of a preempted worker, which the workers and `zeroshard launch` share."""

from __future__ import annotations


class ZeroshardError(Exception):
    """Base class of every error zeroshard raises deliberately."""


class ConfigError(ZeroshardError, ValueError):
    """A ds_config value is wrong: unknown key, wrong type or range, unresolvable "auto"."""


class ConfigConflictError(ConfigError, AssertionError):
    """Config values that cannot go together, where DeepSpeed asserts against the pair at
    initialize() (`managed_gradient_accumulation: false` with overlap_comm at stage 0-1, or with a
    PipelineModule). Also an AssertionError, so code catching DeepSpeed's assertion keeps working."""


class NotSupportedError(ConfigError):
    """A valid DeepSpeed key whose feature zeroshard does not implement yet."""


class CommError(ZeroshardError, RuntimeError):
    """A collective failed or timed out; the message names each rank's last collective."""


class LaunchError(ZeroshardError, RuntimeError):
    """The launcher was given something it cannot run (hostfile, port, script)."""


class CheckpointError(ZeroshardError, RuntimeError):
    """A checkpoint cannot be saved or loaded: missing tag, truncated or foreign file, or a
    manifest that does not match the model; the message names the file and the mismatch."""


class CheckpointArgumentError(CheckpointError, ValueError):
    """A `save_checkpoint` / `load_checkpoint` argument that cannot name a checkpoint (an empty
    `save_dir`). Also a ValueError, as DeepSpeed raises for it."""


class UsageError(ZeroshardError, RuntimeError, AssertionError):
    """An engine call out of order (`step()` inside `no_sync()`, `no_sync()` re-entered), or a step
    the config forbids (a parameter without a gradient under `ignore_unused_parameters: false`). Also an
    AssertionError because DeepSpeed asserts these conditions, so code (and DeepSpeed's own tests)
    catching AssertionError around them keeps working; a RuntimeError for zeroshard's callers."""


class LossError(ZeroshardError, ValueError, AssertionError):
    """A loss `engine.backward` or `engine.scale` cannot take: not a scalar tensor, or (for
    `scale`) without a graph. A ValueError, and an AssertionError because DeepSpeed asserts these
    (code and DeepSpeed's tests catching AssertionError keep working)."""


class InitializeArgumentError(ZeroshardError, TypeError, AssertionError):
    """`initialize()` called without a model, or with the model where DeepSpeed's signature puts
    `args`. A TypeError (wrong arguments) and an AssertionError, as DeepSpeed asserts these."""


PREEMPTED_EXIT_CODE = 75
"""The exit status of a worker that was preempted (SIGTERM or SIGUSR1 with `checkpoint.preemption_save`):
it saved an emergency checkpoint, or says why not, and asks to be restarted rather than given up
on. sysexits.h's EX_TEMPFAIL ("temporary failure; the user is invited to retry"). `zeroshard
launch` exits with it too, after a summary (docs/checkpoints.md, "Preemption")."""

PREEMPTION_NOTES_ENV = "ZEROSHARD_PREEMPTION_NOTES"
"""Set by `zeroshard launch` for its local workers: a directory where each preempted rank leaves
`rank{N}.json` (step, checkpoint, seconds), which the launcher summarizes (torchrun's own exit
status is 1 whatever its workers' were)."""
