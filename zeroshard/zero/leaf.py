"""ZeRO-3 leaf modules (DeepSpeed's `set_z3_leaf_modules`): a module gathered as one unit.

A mixture-of-experts block runs a data-dependent subset of its experts, so per-expert gathering
would pair different collectives on different ranks. Marking the block a *leaf* makes it one
stage-3 unit: all its parameters (experts included) are gathered before its forward and
released after, and no unit is formed inside it. The mark is DeepSpeed's module attribute
`_z3_leaf`, so models marked for DeepSpeed work unchanged. `leaf_units` turns marks into units.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from torch import nn

# Marked at stage 3 unless zero_optimization.leaf_module.classes says otherwise (DeepSpeed 0.19.8's).
from zeroshard.config.schema_zero import DEFAULT_LEAF_MODULE_CLASSES as DEFAULT_LEAF_CLASSES  # noqa: F401 (re-exported: the name tests and callers import from here)


def _qualified(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(module: nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    return type(module).__name__ == wanted or _qualified(module) == wanted


def _set(model: nn.Module, classes: Sequence[type | str], flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes must hold module classes or class names, got {bad!r}")
    found = []
    for m in model.modules():
        if any(_matches(m, c) for c in classes):
            m._z3_leaf = flag  # type: ignore[assignment]
            found.append(m)
    if not found and raise_if_not_found:
        raise ValueError(f"no module of a class in {list(classes)!r} found in the model "
                         f"({type(model).__name__}); check the class names")
    return found


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str],
                        raise_if_not_found: bool = True) -> list[nn.Module]:
    """Mark every module of these classes (types, class names or qualified names) a leaf.

    Returns:
        The marked modules.

    Raises:
        ValueError: none matched and `raise_if_not_found`.
    """
    return _set(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: Sequence[type | str],
                          raise_if_not_found: bool = True) -> list[nn.Module]:
    return _set(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    model._z3_leaf = flag  # type: ignore[assignment]


def z3_leaf_module(model: nn.Module) -> bool:
    """True when `model` is marked a ZeRO-3 leaf."""
    return bool(getattr(model, "_z3_leaf", False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_modules_by_name(model: nn.Module, module_names: Sequence[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules with these `named_modules()` names. Returns (marked, names not found)."""
    named = dict(model.named_modules())
    missing = [n for n in module_names if n not in named]
    if missing and raise_if_not_found:
        raise ValueError(f"no module named {missing!r} in the model")
    marked = [named[n] for n in module_names if n in named]
    for m in marked:
        m._z3_leaf = flag  # type: ignore[assignment]
    return marked, missing


def set_z3_leaf_modules_by_suffix(model: nn.Module, module_name_suffixes: Sequence[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules whose name ends with one of the suffixes. Returns (marked, unmatched)."""
    marked, used = [], set()
    for name, m in model.named_modules():
        for suffix in module_name_suffixes:
            if name.endswith(suffix):
                m._z3_leaf = flag  # type: ignore[assignment]
                marked.append(m)
                used.add(suffix)
                break
    missing = [s for s in module_name_suffixes if s not in used]
    if missing and raise_if_not_found:
        raise ValueError(f"no module name ends with {missing!r}")
    return marked, missing


def apply_leaf_config(model: nn.Module, classes: Sequence[str], names: Sequence[str],
                      name_suffixes: Sequence[str]) -> list[nn.Module]:
    """`zero_optimization.leaf_module` {classes, names, name_suffixes}: mark what matches
    (nothing raises: DeepSpeed's default class list names models that may be absent)."""
    marked = _set(model, list(classes), True, raise_if_not_found=False)
    marked += set_z3_leaf_modules_by_name(model, [n for n in names if n], raise_if_not_found=False)[0]
    marked += set_z3_leaf_modules_by_suffix(model, list(name_suffixes), raise_if_not_found=False)[0]
    return marked


def leaf_units(module: nn.Module, units: Sequence[nn.Module]) -> list[nn.Module]:
    """`units` (root first) with every outermost leaf module added as a unit and every unit
    strictly inside a leaf dropped: a leaf's whole subtree is gathered together."""
    leaves: list[nn.Module] = []
    inside: set[int] = set()

    def walk(m: nn.Module, in_leaf: bool) -> None:
        for child in m.children():
            if in_leaf:
                inside.add(id(child))
                walk(child, True)
            elif z3_leaf_module(child):
                leaves.append(child)
                walk(child, True)
            else:
                walk(child, False)

    if z3_leaf_module(module):
        return [module]
    walk(module, False)
    if not leaves:
        return list(units)
    kept = [u for u in units if id(u) not in inside]
    known = {id(u) for u in kept}
    return kept + [leaf for leaf in leaves if id(leaf) not in known]


_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
"""Never a unit by granularity: a container's forward may never run (DeepSpeed skips them too)."""
_MAX_LEAF_NUMEL = 10**9
"""A module above this many elements is never a unit by granularity (too much gathered at once)."""
_NEVER = sys.maxsize


def module_granularity(module: nn.Module) -> dict[int, int]:
    """`stage3_module_granularity_threshold`'s measure, by module id, as DeepSpeed 0.19.8
    defines it: a module's parameter elements (its own and its descendants') divided by the
    non-container modules with parameters in its subtree, itself included. Modules without
    parameters, modules without children and containers get `sys.maxsize` (never chosen)."""
    out: dict[int, int] = {}

    def walk(m: nn.Module) -> tuple[int, int]:  # (layers, elements) under m
        if next(m.parameters(), None) is None:
            out[id(m)] = _NEVER
            return 0, 0
        numel = sum(p.numel() for p in m.parameters(recurse=False))
        children = list(m.children())
        if not children:
            out[id(m)] = _NEVER
            return 1, numel
        layers = 0
        for child in children:
            child_layers, child_numel = walk(child)
            layers, numel = layers + child_layers, numel + child_numel
        if isinstance(m, _CONTAINERS):
            out[id(m)] = _NEVER
            return layers, numel
        layers += 1
        out[id(m)] = numel // layers if numel <= _MAX_LEAF_NUMEL else _NEVER
        return layers, numel

    walk(module)
    return out


def granularity_units(module: nn.Module, units: Sequence[nn.Module], threshold: int) -> tuple[list[nn.Module], int]:
    """`units` (root first) coarsened by `stage3_module_granularity_threshold`.

    DeepSpeed gathers every module on its own, so it marks the outermost modules whose
    granularity (`module_granularity`) is at most `threshold` as leaves: each is then fetched
    in one piece instead of submodule by submodule. zeroshard already gathers whole units (a
    `ModuleList` block, the root), so the same choice can only coarsen: such a module that
    contains units replaces them (fewer, larger gathers); one that lies inside a unit is
    already gathered in one piece with it and changes nothing (making it a unit of its own
    would split that unit into more gathers, the opposite of what the option asks for).

    Returns:
        The units, and the smallest granularity in the model (for the caller's message when
        nothing qualified).
    """
    gran = module_granularity(module)
    chosen: list[nn.Module] = []

    def pick(m: nn.Module) -> None:  # outermost qualifying modules first, as DeepSpeed's preorder
        if next(m.parameters(), None) is None:
            return
        if gran[id(m)] <= threshold:
            chosen.append(m)
            return
        for child in m.children():
            pick(child)

    pick(module)
    out = list(units)
    for leaf in chosen:
        inner = {id(m) for m in leaf.modules() if m is not leaf}
        if not any(id(u) in inner for u in out):  # no unit inside: it is part of one already
            continue
        placed, coarser = any(u is leaf for u in out), []
        for u in out:  # the leaf takes the place of the first unit inside it
            if id(u) not in inner:
                coarser.append(u)
            elif not placed:
                coarser.append(leaf)
                placed = True
        out = coarser
    return out, min(gran.values(), default=_NEVER)
