"""Accepted means acted on (issue 11): every schema key is acted on (and its consumer really reads
it), refused unless at its default, or listed as accepted without effect with a reason."""

from __future__ import annotations

import importlib
import inspect
import re
from collections import Counter
from pathlib import Path

import pytest
from test_config_defaults import zeroshard_defaults

from zeroshard.config import load_config
from zeroshard.config.effects import ACTED_ON, NO_EFFECT, effect_of, support_key
from zeroshard.config.fields import default_at
from zeroshard.config.reference import render_reference
from zeroshard.config.support import check_supported
from zeroshard.errors import NotSupportedError

PACKAGE = Path(__file__).resolve().parents[2] / "zeroshard"
KEYS = sorted([*zeroshard_defaults(), "optimizer.type", "optimizer.params", "scheduler.type", "scheduler.params"])


def _consumed(key: str, consumer: str) -> bool:
    leaf = key.rpartition(".")[2]
    if consumer.startswith("class:"):
        module, _, name = consumer[len("class:"):].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        return leaf in inspect.signature(cls).parameters
    path, _, text = consumer.partition("::")
    assert not path.startswith("config/"), f"{key}: a consumer inside config/ does not count"
    source = (PACKAGE / path).read_text(encoding="utf-8")
    return text in source if text else re.search(rf"\b{re.escape(leaf)}\b", source) is not None


@pytest.mark.parametrize("key", KEYS)
def test_every_key_is_acted_on_refused_or_listed(key: str) -> None:
    effect = effect_of(key)  # KeyError: a key in none of the three tables
    assert not (key in ACTED_ON and key in NO_EFFECT), f"{key} is both acted on and without effect"
    if effect == "refused unless default":
        assert key not in ACTED_ON and key not in NO_EFFECT, f"{key} is refused and also listed"
    if effect == "acted on":
        missing = [c for c in ACTED_ON[key] if not _consumed(key, c)]
        assert not missing, f"{key}: the listed consumer(s) {missing} do not read it"
    if effect == "accepted without effect":
        assert len(NO_EFFECT[key]) > 30, f"{key}: say why it has no effect"


def test_tables_name_only_schema_keys() -> None:
    assert set(ACTED_ON) - set(KEYS) == set() and set(NO_EFFECT) - set(KEYS) == set()


def test_refused_keys_really_raise() -> None:
    """For each refused key, a non-default value raises NotSupportedError naming it."""
    base = load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3}}, dp_world_size=1)
    for key in (k for k in KEYS if effect_of(k) == "refused unless default" and "[" not in k):
        default = default_at(base, key)
        other = {bool: lambda d: not d, int: lambda d: d + 7, float: lambda d: d / 2 + 0.25,
                 str: lambda d: "x"}.get(type(default))
        if other is None:
            continue
        probe = _with(base, key, other(default))
        with pytest.raises(NotSupportedError, match=re.escape(support_key(key))):
            check_supported(probe, {}, ())


def _with(cfg: object, key: str, value: object) -> object:
    import dataclasses
    head, _, leaf = key.partition(".")
    if not leaf:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: _with(getattr(cfg, head), leaf, value)})


def test_counts_and_reference_column() -> None:
    counts = Counter(effect_of(k) for k in KEYS)
    assert sum(counts.values()) == len(KEYS) and min(counts.values()) > 10, counts
    doc = render_reference()
    assert "accepted without effect: every zeroshard checkpoint loads at any world size" in doc
    assert "| `gradient_clipping` | float | `1.0` | all | acted on |" in doc
    assert "| `stage3_allgather_sequential` | bool | `false` | 3 | not supported yet (default only) |" in doc
