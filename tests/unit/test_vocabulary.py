"""One word, one meaning (STYLE §1 and §3): no two modules under zeroshard/ share a name unless
they mean the same thing (an explicit, reasoned list); "checkpoint" names model state and
"activation checkpointing" names recompute, in every module and class name; DeepSpeed's module
paths inside zeroshard (`zeroshard.checkpointing`, `zeroshard.runtime.zero.stage3`, ...) are
served by compat/paths.py, never by files that would share a name with zeroshard's own code.
"""

from __future__ import annotations

import ast
import importlib
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "zeroshard"
ALIAS_TREE = ROOT / "compat" / "alias"  # DeepSpeed's own layout, mirrored name for name on purpose

SAME_MEANING: dict[frozenset[str], str] = {
    frozenset({"cli/estimate.py", "estimate/"}): "the `zeroshard estimate` command, the front end of estimate/",
    frozenset({"cli/plan.py", "estimate/plan.py"}): "the `zeroshard plan` command, the front end of estimate/plan.py",
    frozenset({"cli/to_fp32.py", "checkpoint/to_fp32.py"}):
        "the `zeroshard to-fp32` command, the front end of checkpoint/to_fp32.py",
    frozenset({"config/load.py", "checkpoint/load.py"}):
        "load = read the package's subject from its files (a ds_config; a checkpoint), the same verb",
    frozenset({"compat/comm.py", "comm/"}):
        "process-group set-up: compat/comm.py is comm/'s init_distributed as the `deepspeed` alias serves it",
    frozenset({"checkpoint/", "tensor_parallel/checkpoint.py"}):
        "model-state checkpoints: tensor_parallel/checkpoint.py keys a tensor-parallel run's files by global names",
    frozenset({"comm/topology.py", "pipe/topology.py"}):
        "the rank layout over (pp, dp, tp): pipe/topology.py serves DeepSpeed's topology classes as views of it",
    frozenset({"sequence/", "tensor_parallel/sequence.py"}):
        "sequence parallelism, each rank holding a slice of the sequence: over the tensor-parallel group "
        "between its regions (tensor_parallel/sequence.py, Megatron's), over the sequence-parallel group "
        "(sequence/, Ulysses)",
    frozenset({"moe/utils.py", "utils/"}):
        "DeepSpeed's paths deepspeed.moe.utils and deepspeed.utils: the helpers scripts import from each",
}
"""Pairs of modules that share a name and mean the same thing, each with the reason."""


def _modules() -> dict[str, list[str]]:
    """name -> the modules (files "a/b.py", packages "a/") that carry it, outside the alias tree."""
    names: dict[str, list[str]] = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        if ALIAS_TREE in path.parents:
            continue
        rel = path.relative_to(ROOT)
        if path.name == "__init__.py":
            if rel.parent != Path("."):
                names[rel.parent.name].append(f"{rel.parent.as_posix()}/")
        else:
            names[path.stem].append(rel.as_posix())
    return names


def test_no_two_modules_share_a_name_with_different_meanings() -> None:
    shared = {frozenset(paths) for paths in _modules().values() if len(paths) > 1}
    unexplained = sorted(sorted(s) for s in shared - SAME_MEANING.keys())
    assert not unexplained, (f"modules sharing a name: {unexplained}. Rename one so the name says what it "
                             "holds, or, if both mean the same thing, add the pair to SAME_MEANING with the reason")
    stale = sorted(sorted(s) for s in SAME_MEANING.keys() - shared)
    assert not stale, f"SAME_MEANING lists pairs that no longer share a name: {stale}"


def _uses_recompute(tree: ast.Module) -> bool:
    """The module calls torch.utils.checkpoint (activation checkpointing: recompute in backward)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("torch.utils.checkpoint", "torch.utils") and (
                node.module == "torch.utils.checkpoint" or any(a.name == "checkpoint" for a in node.names)):
            return True
        if isinstance(node, ast.Import) and any(a.name == "torch.utils.checkpoint" for a in node.names):
            return True
    return False


def _checkpoint_names() -> list[tuple[str, str, str, bool]]:
    """(module, "module" or "class", a name containing "checkpoint", whether the module recomputes)."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        if ALIAS_TREE in path.parents:
            continue
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        recompute = _uses_recompute(tree)
        if "checkpoint" in path.stem:
            out.append((rel, "module", path.stem, recompute))
        out += [(rel, "class", n.name, recompute) for n in ast.walk(tree)
                if isinstance(n, ast.ClassDef) and "checkpoint" in n.name.lower()]
    return out


def test_checkpoint_means_model_state_and_activation_checkpointing_means_recompute() -> None:
    """A module named for checkpoints says "activation" exactly when it recomputes (calls
    torch.utils.checkpoint); a class named for checkpoints in such a module says it too. (A class
    elsewhere may name the recompute's settings, as config/schema.py's ActivationCheckpointingConfig.)"""
    names = _checkpoint_names()
    assert any(recompute for *_, recompute in names), "no activation-checkpointing module found"
    wrong = [f"{module}: {kind} {name}" for module, kind, name, recompute in names
             if ("activation" in name.lower()) != recompute and (kind == "module" or recompute)]
    assert not wrong, ("a name with 'checkpoint' must say 'activation' exactly when it is about recompute "
                       f"(torch.utils.checkpoint): {wrong}")


def test_deepspeed_paths_are_served_from_the_table_not_files() -> None:
    from zeroshard.compat import paths

    for served in paths.served_paths():
        rel = Path(*served.split(".")[1:])
        assert not (ROOT / rel).with_suffix(".py").exists() and not (ROOT / rel / "__init__.py").exists(), (
            f"{served}: a file at a path compat/paths.py serves")
        module = importlib.import_module(served)
        missing = [n for n in paths.VIEWS.get(served, {}) if not hasattr(module, n)]
        assert not missing, f"{served} lacks {missing}"


def test_deepspeed_path_aliases_are_the_module_itself() -> None:
    import zeroshard.optim.lr_schedules as lr_schedules
    import zeroshard.runtime.lr_schedules as served

    assert served is lr_schedules and served.__spec__.name == "zeroshard.optim.lr_schedules"
    import zeroshard.checkpointing as ckpt
    from zeroshard import activation_checkpointing

    assert ckpt.CudaRNGStatesTracker is activation_checkpointing.RNGStatesTracker
    assert ckpt.settings is activation_checkpointing.settings
    with pytest.raises(AttributeError, match="zeroshard does not provide"):
        ckpt.no_such_name  # noqa: B018  the attribute access is the test
