"""Lazy re-export for the deepspeed alias: each `deepspeed.X.name` resolves to zeroshard's own
object on first access, so importing the alias stays cheap and a name zeroshard does not have
yet fails with an error that says so (instead of an import error for the whole package)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def reexport(module_name: str, targets: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for an alias module.

    Args:
        module_name: the alias module's name (e.g. "deepspeed.utils"), for error messages.
        targets: name -> "zeroshard.module:attribute".
    """

    def __getattr__(name: str) -> Any:  # noqa: N807  a module's __getattr__ (PEP 562)
        target = targets.get(name)
        if target is None:
            raise AttributeError(
                f"module {module_name!r} (served by zeroshard) has no attribute {name!r}: zeroshard "
                "does not provide this DeepSpeed name; see docs/deepspeed-differences.md")
        mod_name, _, attr = target.partition(":")
        try:
            value = getattr(importlib.import_module(mod_name), attr) if attr else importlib.import_module(mod_name)
        except (ImportError, AttributeError) as e:
            raise AttributeError(
                f"{module_name}.{name} is mapped to zeroshard's {target}, which is not available "
                f"in this zeroshard version: {e}") from e
        return value

    def __dir__() -> list[str]:  # noqa: N807  a module's __dir__ (PEP 562)
        return sorted(targets)

    return __getattr__, __dir__
