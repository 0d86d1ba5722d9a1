"""Render a resolved Config as an indented `key = value` listing with each value's provenance.

Works on any schema dataclass instance through `dataclasses.fields`, so it imports no schema
module (schema.py imports this one). Imports nothing of zeroshard but `config.fields`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from zeroshard.config.fields import default_of, is_section, show

_COMMENT_COLUMN = 48


def _line(indent: int, key: str, value: Any, source: str | None) -> str:
    text = f"{'  ' * indent}{key} = {show(value)}"
    if source is None:
        return text
    return f"{text.ljust(_COMMENT_COLUMN)}  # {source}"


def _render(obj: Any, prefix: str, indent: int, sources: Mapping[str, str],
            non_default_only: bool, out: list[str]) -> None:
    scalars: list[str] = []
    sections: list[tuple[str, Any]] = []
    for f in dataclasses.fields(obj):
        if not f.metadata.get("json_key", True):
            continue
        value = getattr(obj, f.name)
        path = f"{prefix}{f.name}"
        if value is not None and (is_section(type(value)) or isinstance(value, Mapping)):
            sections.append((f.name, value))
            continue
        default = default_of(f)
        is_default = default is not dataclasses.MISSING and value == default
        source = sources.get(path)
        if is_default and source is None:
            if non_default_only:
                continue
            scalars.append(_line(indent, f.name, value, None))
        else:
            scalars.append(_line(indent, f.name, value, source or "default"))
    out.extend(scalars)
    for name, value in sections:
        sub: list[str] = []
        if isinstance(value, Mapping):
            for key, item in value.items():
                sub.append(_line(indent + 1, key, item, sources.get(f"{prefix}{name}.{key}", "file")))
        else:
            _render(value, f"{prefix}{name}.", indent + 1, sources, non_default_only, sub)
        if sub or not non_default_only:
            out.append(f"{'  ' * indent}{name}:")
            out.extend(sub)


def describe_config(cfg: Any, *, non_default_only: bool = False) -> str:
    """The listing behind `Config.describe()`; see there."""
    header = (
        f"precision = {cfg.precision}, data-parallel world size = {cfg.dp_world_size}, "
        f"train_batch_size = {cfg.train_micro_batch_size_per_gpu} (micro-batch) * "
        f"{cfg.gradient_accumulation_steps} (accumulation) * {cfg.dp_world_size} (ranks) "
        f"= {cfg.train_batch_size}"
    )
    out = [header]
    _render(cfg, "", 0, cfg.sources, non_default_only, out)
    return "\n".join(out)
