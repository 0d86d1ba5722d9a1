"""The engine's state has one home: no module but runtime/engine.py reads an engine underscore
name (mixins included), strategies are asked, never probed, and the micro-batch phases move as
Note: [micro-batch phases] (runtime/engine_state.py) says. No process group."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from zeroshard.runtime.engine import ZeroEngine
from zeroshard.runtime.engine_state import MicroBatchState, Phase
from zeroshard.zero.strategy import ZeroStrategy

PACKAGE = Path(__file__).resolve().parents[2] / "zeroshard"
ENGINE = PACKAGE / "runtime" / "engine.py"


def _sources() -> list[tuple[Path, str]]:
    return [(p, p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))]


def test_no_module_outside_the_engine_reads_an_engine_underscore_name() -> None:
    pattern = re.compile(r"\b\w*engine\._[A-Za-z]")
    hits = [f"{p.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
            for p, text in _sources() if p != ENGINE
            for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
    assert len(_sources()) > 50, "the walk must see the package"
    assert hits == [], "read the engine's public properties (comm, strategy, grads_ready, ...) instead:\n" + \
        "\n".join(hits)


def _self_underscore_reads_and_defs(cls: ast.ClassDef) -> tuple[set[str], set[str]]:
    reads: set[str] = set()
    defined = {f.name for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    defined |= {t.id for a in cls.body if isinstance(a, ast.Assign) for t in a.targets if isinstance(t, ast.Name)}
    defined |= {a.target.id for a in cls.body if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
                and a.value is not None}
    for node in ast.walk(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            (defined if isinstance(node.ctx, ast.Store) else reads).add(node.attr)
    return reads, defined


def test_engine_mixins_in_other_files_read_only_their_own_underscore_names() -> None:
    mixins = [b for b in ZeroEngine.__mro__[1:] if b.__module__.startswith("zeroshard.")]
    assert mixins, "ZeroEngine's in-package bases"
    for base in mixins:
        path = PACKAGE.parent / (base.__module__.replace(".", "/") + ".py")
        cls = next(n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)
                   and n.name == base.__name__)
        reads, defined = _self_underscore_reads_and_defs(cls)
        assert reads <= defined, f"{base.__name__} reads engine state {sorted(reads - defined)}; use a public name"


def test_strategies_are_asked_not_probed() -> None:
    probe = re.compile(r"\b(hasattr|getattr)\(\s*(self\.)?_?strategy\b")
    hits = [f"{p.relative_to(PACKAGE.parent)}:{n}" for p, text in _sources()
            for n, line in enumerate(text.splitlines(), 1) if probe.search(line)]
    assert hits == [], f"capabilities are ZeroStrategy methods with defaults: {hits}"


class _Minimal(ZeroStrategy):
    """A strategy that overrides none of the capabilities."""


def test_strategy_capabilities_have_defaults() -> None:
    strategy = _Minimal()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert strategy.wrap_optimizer(opt) is opt
    assert not strategy.keeps_local_grads()
    strategy.set_grad_reduction(True)  # reducing is every strategy's default
    with pytest.raises(AssertionError, match="keeps_local_grads"):
        strategy.set_grad_reduction(False)


def test_micro_batch_phases_follow_a_step() -> None:
    s = MicroBatchState()
    assert not s.is_boundary(0, 2) and s.is_boundary(1, 2)
    s.forward(training=True)
    assert s.phase is Phase.FORWARD and s.awaits_backward and not s.grads_ready
    s.begin_backward(reduces=False)
    s.end_backward()
    assert s.phase is Phase.IDLE and s.pending_backwards == 1
    s.forward(training=True)
    s.scaled()
    s.forward(training=True)  # a second forward keeps the scaled loss's permission
    assert s.phase is Phase.SCALED and s.awaits_backward
    s.begin_backward(reduces=True)
    assert not s.awaits_backward
    s.end_backward()
    assert s.grads_ready and s.pending_backwards == 2
    s.forward(training=False)  # an evaluation forward leaves the reduced gradients alone
    assert s.grads_ready
    s.stepped()
    assert s.phase is Phase.IDLE and s.pending_backwards == 0


def test_evaluation_forward_drops_a_pending_training_forward() -> None:
    s = MicroBatchState()
    s.forward(training=True)
    s.forward(training=False)
    assert s.phase is Phase.IDLE and not s.awaits_backward
    s.forward(training=True)
    s.stepped()  # a load while a forward awaits its backward: the forward still awaits it
    assert s.awaits_backward
    s.scaled()
    s.forward(training=False)  # a scaled loss still awaits its (direct) backward
    assert s.phase is Phase.SCALED


def test_boundary_requests() -> None:
    s = MicroBatchState(boundary_override=True)
    assert s.is_boundary(0, 4) and s.reduces(0, 4)
    s.no_sync = True
    assert s.is_boundary(0, 4) and not s.reduces(0, 4), "no_sync accumulates; the boundary answer is unchanged"
    s.boundary_override = False
    assert not s.is_boundary(3, 4)
