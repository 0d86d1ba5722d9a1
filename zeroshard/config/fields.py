"""Schema plumbing: field metadata (`spec`), value coercion with located errors, field docstrings.

Used by the schema modules and the loader. Imports nothing of zeroshard but `errors`.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import itertools
import json
import math
import sys
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any, Literal, Union

from zeroshard.errors import ConfigError

MAX_INT = sys.maxsize
"""Bound on every integer key (int64 max): no element count or step count can be larger."""

MAX_SAMPLES = 2**31 - 1
"""Bound on the batch-size keys: a batch of 2**31 samples is larger than any real run, and the
bound stops a typo such as 1e30 from being derived into an absurd micro-batch."""

AUTO = "auto"
"""The value HF Transformers / Accelerate configs use for "fill this in for me"."""


def spec(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    inf_is_none: bool = False,
    json_key: bool = True,
    int_as_bool: bool = False,
    str_as_list: bool = False,
) -> Any:
    """A dataclass field with range limits for the loader.

    Args:
        default / default_factory: as for `dataclasses.field`; neither means "required".
        ge / gt / le / lt: inclusive / exclusive bounds checked after coercion.
        inf_is_none: JSON `Infinity` (or `null`) reads as None ("never").
        json_key: False for fields that are not ds_config keys (set by the loader itself).
        int_as_bool: a bool key DeepSpeed reads by truthiness, so an integer is read as its
            truth value (0 false, any other true).
        str_as_list: a list key DeepSpeed also takes as one string (a one-item list).
    """
    meta = {"ge": ge, "gt": gt, "le": le, "lt": lt, "inf_is_none": inf_is_none, "json_key": json_key,
            "int_as_bool": int_as_bool, "str_as_list": str_as_list}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def show(value: Any) -> str:
    """Render a config value as the user wrote it (JSON spelling: true, null, "cpu")."""
    if isinstance(value, float) and not math.isfinite(value):
        return "Infinity" if value > 0 else ("-Infinity" if value < 0 else "NaN")
    if isinstance(value, Path):
        value = str(value)
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def close_matches(word: str, candidates: Iterable[str]) -> str:
    """' Did you mean "x"?' (or "x" or "y" when both are about as close), or "" when none is close."""
    by_lower: dict[str, str] = {}
    for c in candidates:
        by_lower.setdefault(c.lower(), c)
    found = difflib.get_close_matches(word.lower(), list(by_lower), n=2, cutoff=0.6)
    if not found:
        return ""
    scores = [difflib.SequenceMatcher(None, word.lower(), f).ratio() for f in found]
    found = [f for f, score in zip(found, scores, strict=True) if score >= scores[0] - 0.05]
    return " Did you mean " + " or ".join(f'"{by_lower[f]}"' for f in found) + "?"


def unknown_key(path: str, key: str, known: Iterable[str]) -> ConfigError:
    """The error for a key the schema does not have, with near matches."""
    hint = close_matches(key, known)
    if not hint:
        hint = " Known keys: " + ", ".join(sorted(known)) + "."
    return ConfigError(f"{path}: unknown key.{hint}")


# --- type introspection ----------------------------------------------------------------------


@cache
def hints(cls: type) -> dict[str, Any]:
    """Resolved annotations of a schema dataclass (cached: the schema never changes)."""
    return typing.get_type_hints(cls)


def is_section(tp: Any) -> bool:
    """True when `tp` is a nested schema dataclass (a JSON object), not a leaf value."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _union_args(tp: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return None


def describe_type(tp: Any, meta: Mapping[str, Any] | None = None) -> str:
    """What a value of type `tp` must look like, in words (for errors and docs)."""
    meta = meta or {}
    args = _union_args(tp)
    if args is not None:
        inner = [a for a in args if a is not type(None)]
        text = " or ".join(describe_type(a, meta) for a in inner)
        return text + " or null"
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(show(c) for c in typing.get_args(tp))
    if tp is bool:
        return "true or false"
    parts = [f"{op} {show(meta[k])}" for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
             if meta.get(k) is not None]
    bounds = (" " + " and ".join(parts)) if parts else ""
    if tp is int:
        return "an integer" + bounds
    if tp is float:
        return "a number" + bounds
    if tp is str:
        return "a string"
    if tp is Path:
        return "a path (string)"
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return "a list of " + describe_type(args[0]).replace("a ", "", 1) + "s"
        each = ("," + bounds.replace(" ", " each ", 1)) if bounds else ""
        return ("a pair of numbers" if len(args) == 2 else f"a list of {len(args)} numbers") + each
    return getattr(tp, "__name__", str(tp))


# --- coercion --------------------------------------------------------------------------------


def _fail(path: str, value: Any, tp: Any, meta: Mapping[str, Any], default: Any, extra: str = "") -> ConfigError:
    fix = extra
    if not fix and default is not dataclasses.MISSING:
        fix = f" Default: {show(default)}."
    return ConfigError(f"{path}: got {show(value)}, expected {describe_type(tp, meta)}.{fix}")


def _check_bounds(path: str, value: Any, tp: Any, meta: Mapping[str, Any], default: Any) -> None:
    ok = True
    if meta.get("ge") is not None and not value >= meta["ge"]:
        ok = False
    if meta.get("gt") is not None and not value > meta["gt"]:
        ok = False
    if meta.get("le") is not None and not value <= meta["le"]:
        ok = False
    if meta.get("lt") is not None and not value < meta["lt"]:
        ok = False
    if not ok:
        raise _fail(path, value, tp, meta, default)


def coerce(value: Any, tp: Any, path: str, meta: Mapping[str, Any] | None = None,
           default: Any = dataclasses.MISSING) -> Any:
    """Check `value` (parsed JSON) against `tp` and return it in its typed form.

    Ints accept integral floats (JSON writers turn 5e8 into 500000000.0); bools are never
    numbers; Literal strings match case-insensitively and return the canonical spelling.

    Raises:
        ConfigError: naming `path`, the value, the expectation and the default.
    """
    meta = meta or {}
    args = _union_args(tp)
    if args is not None:
        if value is None and type(None) in args:
            return None
        if meta.get("inf_is_none") and isinstance(value, float) and value == math.inf:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise AssertionError(f"expected one non-None union member, got {inner}")
        try:
            return coerce(value, inner[0], path, meta, default)
        except ConfigError:
            raise _fail(path, value, tp, meta, default) from None
    if typing.get_origin(tp) is Literal:
        return _coerce_literal(value, tp, path, default)
    if tp is bool:
        if meta.get("int_as_bool") and isinstance(value, int) and not isinstance(value, bool):
            return value != 0
        if not isinstance(value, bool):
            raise _fail(path, value, tp, meta, default)
        return value
    if tp is int:
        return _coerce_int(value, tp, path, meta, default)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _fail(path, value, tp, meta, default, "" if isinstance(value, (bool, str)) or not isinstance(
                value, float) else " Infinity and NaN are not usable values.")
        value = float(value)
        _check_bounds(path, value, tp, meta, default)
        return value
    if tp is str:
        if not isinstance(value, str):
            raise _fail(path, value, tp, meta, default)
        return value
    if tp is Path:
        if not isinstance(value, (str, Path)) or str(value) == "":
            raise _fail(path, value, tp, meta, default)
        return Path(value)
    if typing.get_origin(tp) is tuple:
        return _coerce_tuple(value, tp, path, meta, default)
    if tp is Any:
        return freeze(value)
    raise AssertionError(f"{path}: schema type {tp!r} has no coercion rule")


def _coerce_int(value: Any, tp: Any, path: str, meta: Mapping[str, Any], default: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, value, tp, meta, default)
    if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        raise _fail(path, value, tp, meta, default)
    result = int(value)
    if meta.get("le") == MAX_SAMPLES and result > MAX_SAMPLES:
        raise _fail(path, value, tp, meta, default, " No real run has a batch of 2**31 samples; check for a typo.")
    if abs(result) > MAX_INT:
        raise ConfigError(f"{path}: got {show(value)}, larger than any real size or count "
                          f"(the bound is {MAX_INT}, the int64 maximum).{_default_hint(default)}")
    _check_bounds(path, result, tp, meta, default)
    return result


def _default_hint(default: Any) -> str:
    return "" if default is dataclasses.MISSING else f" Default: {show(default)}."


def _coerce_literal(value: Any, tp: Any, path: str, default: Any) -> Any:
    choices = typing.get_args(tp)
    for choice in choices:
        if isinstance(choice, str) and isinstance(value, str) and value.lower() == choice.lower():
            return choice
        if not isinstance(choice, str) and not isinstance(value, bool) and value == choice:
            return choice
    extra = close_matches(value, [c for c in choices if isinstance(c, str)]) if isinstance(value, str) else ""
    raise _fail(path, value, tp, {}, default, extra)


def _coerce_tuple(value: Any, tp: Any, path: str, meta: Mapping[str, Any], default: Any) -> tuple[Any, ...]:
    args = typing.get_args(tp)
    if isinstance(value, str) and meta.get("str_as_list"):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise _fail(path, value, tp, meta, default)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
    if len(value) != len(args):
        raise _fail(path, value, tp, meta, default)
    try:
        return tuple(coerce(v, a, f"{path}[{i}]", meta) for i, (v, a) in enumerate(zip(value, args, strict=True)))
    except ConfigError:
        raise _fail(path, value, tp, meta, default) from None


class FrozenDict(Mapping[str, Any]):
    """A read-only mapping that, unlike `types.MappingProxyType`, pickles, deep-copies and hashes
    (a Config may be saved in a checkpoint or sent to another process)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] | Iterable[tuple[str, Any]] = ()) -> None:
        self._data: dict[str, Any] = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(self._data.items()))

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"

    def __reduce__(self) -> tuple[type, tuple[dict[str, Any]]]:
        return (FrozenDict, (self._data,))


def freeze(value: Any) -> Any:
    """JSON value -> immutable equivalent (lists become tuples, objects read-only mappings)."""
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, Mapping):
        return FrozenDict({k: freeze(v) for k, v in value.items()})
    return value


# --- docstrings ------------------------------------------------------------------------------


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a schema class (the string literal under each field)."""
    module = sys.modules[cls.__module__]
    tree = ast.parse(inspect.getsource(module))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            break
    else:
        return {}
    docs: dict[str, str] = {}
    body = node.body
    for stmt, nxt in itertools.pairwise(body):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def json_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of a schema class that are ds_config keys (in declaration order)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("json_key", True)]


def default_of(f: dataclasses.Field[Any]) -> Any:
    """A field's default value, or MISSING when it is required."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def get_dotted(obj: Any, path: str) -> Any:
    """The value at dotted `path` below `obj` (dataclass attributes and mapping keys).

    Raises:
        KeyError: the path does not exist (e.g. below a null optimizer section).
    """
    for part in path.split("."):
        if obj is None:
            raise KeyError(path)
        if isinstance(obj, Mapping):
            obj = obj[part]
        elif dataclasses.is_dataclass(obj) and part in {f.name for f in dataclasses.fields(obj)}:
            obj = getattr(obj, part)
        else:
            raise KeyError(path)
    return obj


def default_at(root: Any, path: str) -> Any:
    """The schema default of dotted `path` below the dataclass instance `root` (MISSING if none)."""
    head, _, leaf = path.rpartition(".")
    owner = get_dotted(root, head) if head else root
    if not dataclasses.is_dataclass(owner):
        return dataclasses.MISSING
    for f in dataclasses.fields(owner):
        if f.name == leaf:
            return default_of(f)
    raise KeyError(path)
