"""The batch triad: train_batch_size = micro_batch * gradient_accumulation_steps * dp_world_size.

A pure function of ints (no process group), solved from any two of the three as DeepSpeed does.
Imports nothing of zeroshard but `errors`.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroshard.errors import ConfigError

TBS = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchSizes:
    """The solved triad and which of its members were derived rather than given."""

    train_batch_size: int
    """Samples per optimizer step over all ranks."""
    train_micro_batch_size_per_gpu: int
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step."""
    derived: frozenset[str]
    """Names of the members computed here (the others were given)."""


def _not_divisible(total: int, divisor: int, divisor_text: str, target: str) -> ConfigError:
    lower = total // divisor * divisor
    example = " or ".join(str(m) for m in (lower, lower + divisor) if m > 0)
    return ConfigError(
        f"{TBS}: {total} is not divisible by {divisor_text} = {divisor}, so {target} cannot be "
        f"derived. Set {TBS} to a multiple of {divisor} (e.g. {example}), or set {target} explicitly."
    )


def solve_batch(
    train_batch_size: int | None,
    train_micro_batch_size_per_gpu: int | None,
    gradient_accumulation_steps: int | None,
    dp_world_size: int,
) -> BatchSizes:
    """Solve the triad from the members given (None = absent or "auto").

    DeepSpeed's rules: all three are checked; any two determine the third; train_batch_size
    alone or micro-batch alone imply gradient_accumulation_steps = 1; fewer is an error.

    Raises:
        ConfigError: inconsistent or indivisible values, or too few given.

    Example:
        >>> solve_batch(32, 4, None, 2).gradient_accumulation_steps
        4
    """
    tbs, micro, gas = train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps
    world = dp_world_size
    if world < 1:
        raise ConfigError(f"data-parallel world size: got {world}, expected an integer >= 1.")
    derived: set[str] = set()
    if tbs is not None and micro is not None and gas is None:
        if tbs % (micro * world):
            raise _not_divisible(tbs, micro * world, f"{MICRO} ({micro}) * data-parallel world size ({world})", GAS)
        gas, derived = tbs // (micro * world), {GAS}
    elif tbs is not None and gas is not None and micro is None:
        if tbs % (gas * world):
            raise _not_divisible(tbs, gas * world, f"{GAS} ({gas}) * data-parallel world size ({world})", MICRO)
        micro, derived = tbs // (gas * world), {MICRO}
    elif micro is not None and gas is not None and tbs is None:
        tbs, derived = micro * gas * world, {TBS}
    elif tbs is not None and micro is None and gas is None:
        if tbs % world:
            raise _not_divisible(tbs, world, "the data-parallel world size", MICRO)
        gas, micro, derived = 1, tbs // world, {GAS, MICRO}
    elif micro is not None and tbs is None and gas is None:
        gas, tbs, derived = 1, micro * world, {GAS, TBS}
    elif tbs is None and micro is None:
        raise ConfigError(
            f"{TBS} and {MICRO} are both missing (or \"auto\" with nothing to resolve them): "
            f"set {MICRO} (samples per rank per forward pass), or {TBS} (samples per optimizer "
            f"step over all ranks), or pass them to initialize() to resolve \"auto\"."
        )
    if tbs is None or micro is None or gas is None:
        raise AssertionError(f"expected a solved triad, got {tbs}, {micro}, {gas}")
    product = micro * gas * world
    if tbs != product:
        raise ConfigError(
            f"{TBS}: {tbs} != {MICRO} ({micro}) * {GAS} ({gas})\n  * data-parallel world size "
            f"({world}) = {product}. Set it to {product}, or set one of the three to \"auto\"."
        )
    return BatchSizes(
        train_batch_size=tbs,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=gas,
        derived=frozenset(derived),
    )
