"""What the suite itself must hold to mean the same on a fresh machine as on a developer's: every
package of the `[test]` extra installed at a version the extra allows (so an optional feature's tests
run, not skip), and no test reaching the `deepspeed` alias's modules by their file path (they import
`deepspeed` themselves, which without the alias active is a real DeepSpeed or nothing)."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _test_extra() -> list[str]:
    """The [test] extra as installed zeroshard's metadata states it (pyproject.toml at install time)."""
    marker = re.compile(r';\s*extra\s*==\s*["\']test["\']')
    return [marker.split(r)[0].strip() for r in md.requires("zeroshard") or [] if marker.search(r)]


@pytest.mark.parametrize("requirement", _test_extra())
def test_the_test_extra_is_installed(requirement: str) -> None:
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        pytest.fail(f"{req.name} (the [test] extra) is not installed: pip install -e '.[test]', as README says")
    assert req.specifier.contains(version, prereleases=True), (
        f"{req.name} {version} is outside the [test] extra's range {req.specifier}: the tests were measured there")


def test_no_test_imports_the_alias_by_its_path() -> None:
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if "deepspeed_unit" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno}" for name in names
                          if re.match(r"zeroshard\.compat\.alias\b", name)]
    assert not offenders, (f"{offenders}: import `deepspeed` with the alias active instead (the "
                           "deepspeed_alias fixture in tests/conftest.py, or ZEROSHARD_AS_DEEPSPEED=1 in a subprocess)")
