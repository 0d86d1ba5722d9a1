"""docs/config.md is current, every schema field is documented, config/ imports no other layer,
and `zeroshard config check` reports as documented."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

import zeroshard.config as config_pkg
from zeroshard.cli.config_cmd import main as config_check
from zeroshard.config.fields import field_docs
from zeroshard.config.reference import render_reference

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "zeroshard" / "config"


def test_reference_doc_is_current() -> None:
    doc = REPO / "docs" / "config.md"
    assert doc.read_text(encoding="utf-8") == render_reference(), (
        "docs/config.md is stale: run `python -m zeroshard.config.reference > docs/config.md`")


@pytest.mark.parametrize("cls", [
    obj for name in config_pkg.__all__
    if dataclasses.is_dataclass(obj := getattr(config_pkg, name)) and isinstance(obj, type)
], ids=lambda c: c.__name__)
def test_every_schema_field_has_a_docstring(cls: type) -> None:
    docs = field_docs(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
    assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_config_imports_nothing_of_zeroshard_but_errors() -> None:
    for path in sorted(CONFIG_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.startswith("zeroshard"):
                    assert name == "zeroshard.errors" or name.startswith("zeroshard.config"), (
                        f"{path.name} imports {name}")


def test_config_check_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"train_batch_size": 16, "zero_optimization": {"reduce_bucket_size": "auto"}}))
    assert config_check([str(good), "--world-size", "4", "--hidden-size", "64"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("OK\n") and "reduce_bucket_size = 4096" in out and "micro-batch" in out
    assert config_check(["check", str(good), "--hidden-size", "64", "--changed"]) == 0
    assert "loss_scale_window" not in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_batch_size": 16, "zero_optimization": {"overlap_comms": True}}))
    assert config_check([str(bad)]) == 2
    assert 'zero_optimization.overlap_comms: unknown key. Did you mean "overlap_comm"?' in capsys.readouterr().err
    assert config_check([str(good), "--auto", "zero_optimization.reduce_bucket_size=100"]) == 0
    assert "reduce_bucket_size = 100" in capsys.readouterr().out
