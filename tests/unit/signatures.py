"""Shared by the tests that check zeroshard's signatures against the installed DeepSpeed
(test_deepspeed_names.py, test_deepspeed_compat_names.py, test_pipe_api.py): a "module:Attr.attr"
path resolved to its object, and both signatures' parameters."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any


def resolve(path: str) -> Any:
    """The object at "package.module:Name.attr"."""
    module, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def parameters(ours: str, theirs: str) -> tuple[Mapping[str, inspect.Parameter], Mapping[str, inspect.Parameter]]:
    """(zeroshard's parameters, DeepSpeed's parameters) of the two paths."""
    return inspect.signature(resolve(ours)).parameters, inspect.signature(resolve(theirs)).parameters
