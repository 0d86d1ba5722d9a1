"""Shared by the tests that check zeroshard's signatures against the installed DeepSpeed
(test_deepspeed_names.py, test_deepspeed_compat_names.py, test_pipe_api.py, test_ulysses_names.py):
a "module:Attr.attr" path resolved to its object, both signatures' parameters, and the exact-match
check."""

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


def assert_same_signature(ours: str, theirs: str, *, kinds: bool = False) -> None:
    """The same parameter names in the same order and the same literal defaults as DeepSpeed's
    (with `kinds`, also positional/keyword kinds and which parameters have no default)."""
    mine, ref = parameters(ours, theirs)
    assert list(mine) == list(ref), f"{ours}: parameters {list(mine)}, DeepSpeed {list(ref)}"
    for name, p in ref.items():
        if kinds:
            assert mine[name].kind == p.kind, f"{ours}({name}): {mine[name].kind}, DeepSpeed {p.kind}"
        literal = isinstance(p.default, (bool, int, float, str, type(None)))
        if literal or (kinds and p.default is inspect.Parameter.empty):
            assert mine[name].default == p.default, f"{ours}({name}=...): default differs"
