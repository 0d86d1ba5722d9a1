"""No class of the package holds more than 25 attributes (its own and its in-package bases'),
as `tools/class_sizes.py` counts them: a class past that size is doing several jobs (issue 38
found the pipeline engine at 31, driving its parent's internals). A class that must grow splits
a helper object off first."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 25


def _tool():  # tools/ is not a package: load the script as a module
    spec = importlib.util.spec_from_file_location("class_sizes", ROOT / "tools" / "class_sizes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("class_sizes", module)
    spec.loader.exec_module(module)
    return module


def _sizes(root: Path) -> dict[str, int]:
    tool = _tool()
    classes = tool.collect(root)
    by_name: dict[str, list] = {}
    for c in classes:
        by_name.setdefault(c.name, []).append(c)
    return {f"{c.module}.{c.name}": len(tool.totals(c, by_name)[0]) for c in classes}


def test_no_class_has_more_than_25_attributes() -> None:
    sizes = _sizes(ROOT / "zeroshard")
    assert len(sizes) > 100, "the tool found almost no classes: is it reading the package?"
    over = {name: n for name, n in sizes.items() if n > LIMIT}
    assert not over, f"classes over {LIMIT} attributes (split a helper object off): {over}"


def test_the_count_includes_in_package_bases(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "class Base:\n    def __init__(self):\n        self.x = 1\n        self.y: int = 2\n\n"
        "class Child(Base):\n    def __init__(self):\n        super().__init__()\n        self.x = 3\n"
        "        self.z, self.w = 4, 5\n")
    sizes = _sizes(pkg)
    assert sizes == {"pkg.a.Base": 2, "pkg.a.Child": 4}


@pytest.mark.parametrize("n", [LIMIT, LIMIT + 1])
def test_the_limit_is_what_fails(tmp_path: Path, n: int) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "".join(f"        self.a{i} = {i}\n" for i in range(n))
    (pkg / "big.py").write_text(f"class Big:\n    def __init__(self):\n{body}")
    assert (_sizes(pkg)["pkg.big.Big"] > LIMIT) == (n > LIMIT)


def _function_lines(path: Path, name: str) -> int:
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, f"{path}: expected one top-level {name}()"
    return found[0].end_lineno - found[0].lineno + 1  # type: ignore[operator]


def test_initialize_stays_under_100_lines() -> None:
    """initialize() composes the engine from named steps (issue 38 found it at 205 lines, deciding the
    dimensions three ways inline); a new step goes into a helper it calls."""
    lines = _function_lines(ROOT / "zeroshard" / "runtime" / "initialize.py", "initialize")
    assert lines < 100, f"initialize() is {lines} lines (docstring included): move a step into a helper"


def test_the_length_check_counts_the_whole_function(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def initialize():\n" + '    """doc."""\n' + "    x = 1\n" * 98 + "\n\ndef other():\n    pass\n")
    assert _function_lines(src, "initialize") == 100
