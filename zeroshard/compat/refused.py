"""DeepSpeed internals zeroshard deliberately does not have, importable by name and refused when used.

Some of DeepSpeed's own test files (and a few scripts) import an internal class only to
`isinstance`-check or patch it, or to read a constant off it. Those imports succeed under the
alias; building, calling or loading one raises NotSupportedError naming it and what zeroshard
does instead. Nothing here does DeepSpeed's work: an `isinstance` check against one of these is
simply False for zeroshard's objects.
"""

from __future__ import annotations

from typing import Any, NoReturn

from zeroshard.errors import NotSupportedError


def refuse(ds_name: str, instead: str) -> NoReturn:
    """Raise NotSupportedError naming the DeepSpeed internal `ds_name` and what to use instead."""
    raise NotSupportedError(f"{ds_name}: a DeepSpeed internal that zeroshard does not have; {instead}")


def refused_class(ds_name: str, instead: str, **class_attrs: Any) -> type:
    """A class named like DeepSpeed's `ds_name` (dotted) whose construction is refused.

    Args:
        ds_name: DeepSpeed's full name, e.g. "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3".
        instead: what zeroshard offers instead (the second half of the message).
        class_attrs: constants DeepSpeed code reads off the class itself (e.g. an op builder's NAME).
    """
    module, _, name = ds_name.rpartition(".")

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807  the refused class's constructor
        refuse(ds_name, instead)

    def __init_subclass__(cls: type, **kwargs: Any) -> None:  # noqa: N807  refuses subclasses too
        refuse(ds_name, instead)

    doc = f"Refused: {ds_name} is a DeepSpeed internal zeroshard does not have; {instead}"
    return type(name, (), {"__init__": __init__, "__init_subclass__": classmethod(__init_subclass__),
                           "__module__": module, "__doc__": doc, "__qualname__": name, **class_attrs})


def refused_function(ds_name: str, instead: str) -> Any:
    """A function named like DeepSpeed's `ds_name` that refuses every call."""
    module, _, name = ds_name.rpartition(".")

    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        refuse(ds_name, instead)

    refused.__name__ = refused.__qualname__ = name
    refused.__module__ = module
    refused.__doc__ = f"Refused: {ds_name} is a DeepSpeed internal zeroshard does not have; {instead}"
    return refused
