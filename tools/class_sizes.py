"""The largest classes of a package: distinct `self.X` attributes assigned and methods defined,
each counted over the class and its bases found in the same package (STYLE §2's measure).

    python tools/class_sizes.py [package dir] [--top N]

Attributes: every name `X` assigned as `self.X = ...` (also `self.X: T = ...`, `self.X += ...`
and tuple targets) in any method. Methods: every `def` in the class body (properties included).
Bases outside the package (nn.Module, Protocol, ...) add nothing.
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ClassInfo:
    name: str
    module: str
    bases: list[str]
    attributes: set[str] = field(default_factory=set)
    methods: set[str] = field(default_factory=set)


def _self_targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return [node.attr]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for elt in node.elts for n in _self_targets(elt)]
    if isinstance(node, ast.Starred):
        return _self_targets(node.value)
    return []


def _class_info(cls: ast.ClassDef, module: str) -> ClassInfo:
    bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in cls.bases]
    info = ClassInfo(cls.name, module, [b for b in bases if b])
    for item in cls.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            info.methods.add(item.name)
            for node in ast.walk(item):
                if isinstance(node, ast.Assign):
                    for t in node.targets:
                        info.attributes.update(_self_targets(t))
                elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                    info.attributes.update(_self_targets(node.target))
    return info


def collect(root: Path) -> list[ClassInfo]:
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        out += [_class_info(n, module) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    return out


def totals(info: ClassInfo, by_name: dict[str, list[ClassInfo]]) -> tuple[set[str], set[str]]:
    """Attributes and methods of `info` with its in-package bases (a base name defined twice
    resolves to the definition in the same module, else the first)."""
    attrs, methods = set(info.attributes), set(info.methods)
    for base in info.bases:
        candidates = by_name.get(base, [])
        if not candidates:
            continue
        chosen = next((c for c in candidates if c.module == info.module), candidates[0])
        if chosen is info:
            continue
        a, m = totals(chosen, by_name)
        attrs |= a
        methods |= m
    return attrs, methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="zeroshard")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--show", action="append", default=[], help="also print this class (repeatable)")
    args = parser.parse_args()
    classes = collect(Path(args.root))
    by_name: dict[str, list[ClassInfo]] = {}
    for c in classes:
        by_name.setdefault(c.name, []).append(c)
    rows = []
    for c in classes:
        attrs, methods = totals(c, by_name)
        rows.append((len(attrs), len(methods), f"{c.module}.{c.name}"))
    rows.sort(key=lambda r: (-r[0], -r[1], r[2]))
    shown = rows[: args.top] + [r for r in rows[args.top:] if r[2].rsplit(".", 1)[1] in args.show]
    print(f"{'attributes':>10} {'methods':>7}  class (with in-package bases)")
    for a, m, name in shown:
        print(f"{a:>10} {m:>7}  {name}")


if __name__ == "__main__":
    main()
