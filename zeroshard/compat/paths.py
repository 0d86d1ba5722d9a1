"""DeepSpeed's module paths inside zeroshard's own namespace (`zeroshard.checkpointing`,
`zeroshard.runtime.lr_schedules`, `zeroshard.runtime.zero.stage3`, ...), served from a table.

A script ported by its import line (`import zeroshard as deepspeed`) imports DeepSpeed's paths.
zeroshard's code lives where its layering puts it (optimizers and schedules in `optim/`, the
activation-checkpointing API in `activation_checkpointing.py`, the estimators in
`estimate/`), so these paths are names, not files: `serve()` (called by `zeroshard/__init__.py`)
puts a finder first on `sys.meta_path` that answers only the paths below (first, so that an
older zeroshard tree on the path, where some of them were files, never answers for them). A path in
`ALIASES` is the same module object as its target; one in `VIEWS` is a module of DeepSpeed's
names only, each read from zeroshard's object on first access (compat/_names.py). The
`deepspeed` alias (compat/alias/) serves the same names at `deepspeed.*`.

Imports nothing of ours but compat/_names.py, and that only when a view is first built.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

_ESTIMATE = "zeroshard.estimate.deepspeed_compat"
_ZERO3 = ["estimate_zero3_model_states_mem_needs", "estimate_zero3_model_states_mem_needs_all_cold",
          "estimate_zero3_model_states_mem_needs_all_live"]
_ZERO2 = ["estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_cold",
          "estimate_zero2_model_states_mem_needs_all_live"]
_ACTIVATION_CHECKPOINTING = "zeroshard.activation_checkpointing"
_OPTIMIZERS = "zeroshard.compat.optimizers"

ALIASES: dict[str, str] = {
    "zeroshard.runtime.lr_schedules": "zeroshard.optim.lr_schedules",
    "zeroshard.runtime.utils": "zeroshard.runtime.memory_usage",
}
"""DeepSpeed path -> zeroshard module; importing the path gives that module itself."""

VIEWS: dict[str, dict[str, str]] = {
    # deepspeed.checkpointing: the activation-checkpointing (recompute) API.
    "zeroshard.checkpointing": {
        **{n: f"{_ACTIVATION_CHECKPOINTING}:{n}" for n in [
            "ActivationCheckpointingSettings", "CheckpointingSettings", "RNGStatesTracker", "checkpoint", "configure",
            "get_cuda_rng_tracker", "is_configured", "model_parallel_cuda_manual_seed",
            "model_parallel_reconfigure_tp_seed", "non_reentrant_checkpoint", "recompute_seconds", "reset",
            "settings"]},
        "CudaRNGStatesTracker": f"{_ACTIVATION_CHECKPOINTING}:RNGStatesTracker",  # DeepSpeed's name
    },
    "zeroshard.runtime.zero": {},  # a package: its submodules below
    "zeroshard.runtime.zero.stage3": {n: f"{_ESTIMATE}:{n}" for n in _ZERO3},
    "zeroshard.runtime.zero.stage_1_and_2": {n: f"{_ESTIMATE}:{n}" for n in _ZERO2},
    # deepspeed.ops: DeepSpeed's optimizer classes, the objects the alias's deepspeed.ops serves.
    "zeroshard.ops": {n: f"zeroshard.ops.{n}" for n in ("adam", "adagrad", "lion")},
    "zeroshard.ops.adam": {n: f"{_OPTIMIZERS}:{n}" for n in ("DeepSpeedCPUAdam", "FusedAdam")},
    "zeroshard.ops.adagrad": {"DeepSpeedCPUAdagrad": f"{_OPTIMIZERS}:DeepSpeedCPUAdagrad"},
    "zeroshard.ops.lion": {n: f"{_OPTIMIZERS}:{n}" for n in ("DeepSpeedCPULion", "FusedLion")},
    # deepspeed.compression.helper: the attribute-path helpers DeepSpeed-Chat's LoRA code imports.
    "zeroshard.compression": {"helper": "zeroshard.compression.helper"},
    "zeroshard.compression.helper": {n: f"zeroshard.compat.helpers:{n}"
                                     for n in ("recursive_getattr", "recursive_setattr")},
    "zeroshard.runtime.zero.partition_parameters": {
        **{n: f"zeroshard.zero.init:{n}" for n in ["GatheredParameters", "Init", "register_external_parameter"]},
        "ZeroParamStatus": "zeroshard.zero.units:ZeroParamStatus",
    },
}
"""DeepSpeed path -> {DeepSpeed's name: "zeroshard.module:attribute"}."""

_PACKAGES = {"zeroshard.runtime.zero", "zeroshard.ops", "zeroshard.compression"}


class _PathLoader(importlib.abc.Loader):
    """Builds the module of one table path: the target itself (alias) or a view."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        target = ALIASES.get(spec.name)
        if target is not None:
            module = importlib.import_module(target)
            self._target_spec = module.__spec__  # import sets __spec__ to ours; exec_module puts it back
            return module
        from zeroshard.compat._names import reexport

        view = ModuleType(spec.name, f"DeepSpeed's `{spec.name.replace('zeroshard', 'deepspeed', 1)}`, "
                                     "served by zeroshard (zeroshard/compat/paths.py).")
        view.__getattr__, view.__dir__ = reexport(spec.name, VIEWS[spec.name])  # type: ignore[method-assign]
        view.__all__ = sorted(VIEWS[spec.name])  # type: ignore[attr-defined]
        return view

    def exec_module(self, module: ModuleType) -> None:
        if module.__name__ != module.__spec__.name:  # an alias: the target keeps its own spec
            module.__spec__ = self._target_spec


class _PathFinder(importlib.abc.MetaPathFinder):
    """Answers the table's paths only; every other import goes to the finders before it."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in ALIASES and fullname not in VIEWS:
            return None
        return importlib.machinery.ModuleSpec(fullname, _PathLoader(), is_package=fullname in _PACKAGES)


def serve() -> None:
    """Make the table's paths importable (idempotent)."""
    if not any(isinstance(f, _PathFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PathFinder())


def served_paths() -> list[str]:
    """Every path the table serves (for tests and docs)."""
    return sorted({*ALIASES, *VIEWS})
