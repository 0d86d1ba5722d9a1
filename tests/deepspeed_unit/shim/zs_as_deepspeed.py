"""A thin renaming shim: DeepSpeed's public names, pointed at zeroshard's.

DeepSpeed's own unit tests import `deepspeed`. For a shimmed run, the real package is imported
(its accelerator, `deepspeed.comm` and its test harness stay: they set up the process group and
devices, which is not what is being measured), then the names a user script calls are replaced
by zeroshard's: `initialize`, `zero.Init`, `zero.GatheredParameters`, the `safe_get_*` /
`safe_set_*` helpers, `zero_to_fp32`, the engine class. A name zeroshard lacks is replaced by a
function raising `ZeroshardMissing` naming it, so a test fails for that reason and the report
can group it, instead of silently running DeepSpeed's own code.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any, Callable


class ZeroshardMissing(AttributeError):  # noqa: N818  an AttributeError by design: hasattr() must see it
    pass


# (DeepSpeed module, attribute) -> candidate zeroshard locations "module:attr", first found wins.
MAPPING: dict[tuple[str, str], list[str]] = {
    ("deepspeed", "initialize"): ["zeroshard:initialize"],
    ("deepspeed", "add_config_arguments"): ["zeroshard:add_config_arguments"],
    ("deepspeed", "DeepSpeedEngine"): ["zeroshard:ZeroEngine"],
    ("deepspeed.runtime.engine", "DeepSpeedEngine"): ["zeroshard:ZeroEngine"],
    ("deepspeed.zero", "Init"): ["zeroshard.zero:Init", "zeroshard.zero.init:Init"],
    ("deepspeed.zero", "GatheredParameters"): ["zeroshard.zero:GatheredParameters",
                                               "zeroshard.zero.init:GatheredParameters"],
    ("deepspeed.zero", "register_external_parameter"): ["zeroshard.zero:register_external_parameter",
                                                        "zeroshard.zero.init:register_external_parameter"],
    ("deepspeed.zero", "unregister_external_parameter"): ["zeroshard.zero:unregister_external_parameter"],
    ("deepspeed.checkpointing", "checkpoint"): ["zeroshard.checkpointing:checkpoint"],
    ("deepspeed.checkpointing", "configure"): ["zeroshard.checkpointing:configure"],
    ("deepspeed.utils.zero_to_fp32", "get_fp32_state_dict_from_zero_checkpoint"): [
        "zeroshard.utils.zero_to_fp32:get_fp32_state_dict_from_zero_checkpoint",
        "zeroshard.checkpoint.to_fp32:get_fp32_state_dict_from_zero_checkpoint"],
    ("deepspeed.utils.zero_to_fp32", "load_state_dict_from_zero_checkpoint"): [
        "zeroshard.utils.zero_to_fp32:load_state_dict_from_zero_checkpoint",
        "zeroshard.checkpoint.to_fp32:load_state_dict_from_zero_checkpoint"],
    ("deepspeed.utils.zero_to_fp32", "convert_zero_checkpoint_to_fp32_state_dict"): [
        "zeroshard.utils.zero_to_fp32:convert_zero_checkpoint_to_fp32_state_dict",
        "zeroshard.checkpoint.to_fp32:convert_zero_checkpoint_to_fp32_state_dict"],
}
for _name in ("safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_grad",
              "safe_get_full_optimizer_state", "safe_set_full_optimizer_state",
              "safe_get_local_fp32_param", "safe_set_local_fp32_param", "safe_get_local_grad",
              "safe_get_local_optimizer_state", "safe_set_local_optimizer_state", "safe_set_local_grad",
              "safe_update_full_grad_vectorized"):
    MAPPING[("deepspeed.utils", _name)] = [f"zeroshard.utils:{_name}"]
    MAPPING[("deepspeed.utils.tensor_fragment", _name)] = [f"zeroshard.utils:{_name}"]

REPORT: dict[str, str] = {}
"""DeepSpeed name -> where it now points (or "MISSING")."""


def _resolve(candidates: list[str]) -> tuple[str, Any] | None:
    for spec in candidates:
        mod_name, attr = spec.split(":")
        try:
            mod = importlib.import_module(mod_name)
            return spec, getattr(mod, attr)
        except (ImportError, AttributeError):
            continue
    return None


def _missing(name: str) -> Callable[..., Any]:
    def raiser(*args: Any, **kwargs: Any) -> Any:
        raise ZeroshardMissing(f"zeroshard has no counterpart of {name}")
    raiser.__name__ = name.rsplit(".", 1)[-1]
    return raiser


def _ds_module(name: str) -> ModuleType:
    """`deepspeed.zero` is an attribute of `deepspeed` (runtime.zero), not an importable path."""
    try:
        return importlib.import_module(name)
    except ImportError:
        obj: Any = importlib.import_module("deepspeed")
        for part in name.split(".")[1:]:
            obj = getattr(obj, part)
        return obj


def patch() -> None:
    """Point every name in MAPPING at zeroshard (or at a named failure), in every module that
    already imported it by value (`from deepspeed.utils import safe_get_full_fp32_param`)."""
    for (mod_name, attr), candidates in MAPPING.items():
        try:
            mod = _ds_module(mod_name)
        except (ImportError, AttributeError) as exc:
            REPORT[f"{mod_name}.{attr}"] = f"not patched: {exc}"
            continue
        old = getattr(mod, attr, None)
        found = _resolve(candidates)
        REPORT[f"{mod_name}.{attr}"] = found[0] if found is not None else "MISSING"
        new = found[1] if found is not None else _missing(f"{mod_name}.{attr}")
        setattr(mod, attr, new)
        if old is None:
            continue
        for other in list(sys.modules.values()):
            if isinstance(other, ModuleType) and other.__name__.startswith("deepspeed") and \
                    getattr(other, attr, None) is old:
                setattr(other, attr, new)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches right after the top-level `deepspeed` package finishes importing."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "deepspeed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("deepspeed")
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch()
        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install_hook() -> None:
    if "deepspeed" in sys.modules:
        patch()
    else:
        sys.meta_path.insert(0, _Finder())
