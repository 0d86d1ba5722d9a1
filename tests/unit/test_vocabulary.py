"""One word, one meaning (STYLE §1 and §3): no two modules under zeroshard/ share a name unless
they mean the same thing (an explicit, reasoned list); "checkpoint" names model state and
"activation checkpointing" names recompute, in every module and class name; DeepSpeed's module
paths inside zeroshard (`zeroshard.checkpointing`, `zeroshard.runtime.zero.stage3`, ...) are
served by compat/paths.py, never by files that would share a name with zeroshard's own code.

Identifiers, one meaning each (issue 38 item 6): "stage" is the pipeline stage; the ZeRO stage is
`zero_stage` in code (its JSON key stays `zero_optimization.stage`); the tensor-parallel axis is
`tp`, never `mp` (Megatron's "model parallel"), except where DeepSpeed or Megatron name it so.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import re
import typing
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


# --- identifiers: "stage" and "mp" -------------------------------------------------------------

PIPELINE_MODULES: dict[str, str] = {
    "pipe/": "the pipeline package: PipelineModule, partition, schedules, topology, failures",
    "runtime/pipe_engine.py": "the pipeline engine (train_batch / eval_batch over the stages)",
    "checkpoint/pipe_files.py": "the pipeline checkpoint layout, one directory per stage",
    "checkpoint/pipe_checkpointer.py": "saves and loads each stage's directory",
    "checkpoint/ds_pipe.py": "DeepSpeed's pipeline checkpoints, one source per saved stage",
    "config/pipeline.py": "the checks of the `pipeline` section against the PipelineModule's stages",
    "estimate/activations.py": "activation memory of one pipeline stage under a schedule",
    "estimate/parallel.py": "memory of one rank of each pipeline stage (3D)",
    "estimate/plan3d.py": "the 3D plan search, whose candidates are pipeline layouts",
}
"""Modules where a bare `stage` names a pipeline stage (everywhere else no identifier says
"stage" unqualified)."""

STAGE_QUALIFIERS = frozenset({"zero", "pipe", "pipeline", "pp"})
"""A "stage" word preceded by one of these words says which stage it is (`zero_stage`, `pp_stage_comm`)."""

DEEPSPEED_STAGE_NAMES: dict[tuple[str, str], str] = {
    ("runtime/engine_queries.py", "zero_optimization_stage"): "DeepSpeed's engine method, "
                                                             "engine.zero_optimization_stage()",
    ("compat/ds_config.py", "zero_optimization_stage"): "DeepSpeedConfig's attribute, as DeepSpeed scripts read it",
    ("runtime/initialize.py", "num_stages"): "passed to PipeLayout (checkpoint/pipe_files.py), whose fields and "
                                             "pipeline.json keys are the PipelineModule's: DeepSpeed's num_stages",
    ("runtime/initialize.py", "virtual_stages"): "passed to PipeLayout beside num_stages: the PipelineModule's "
                                                 "interleaving argument (virtual_stages=v)",
}
"""(module, identifier) outside the pipeline modules that says "stage" unqualified, with the reason:
DeepSpeed's names (and the PipelineModule's, which are pipeline stages)."""

MP_NAMES = frozenset({"mp", "mp_size", "mp_rank", "mp_comm", "mp_group"})
"""The tensor-parallel axis is `tp`: these spell it as Megatron's "model parallel"."""

DEEPSPEED_MP_NAMES: dict[tuple[str, str], str] = {}
"""(module, identifier) pairs allowed to use a name of MP_NAMES, with the reason. Empty: DeepSpeed's
own spellings (`mp_world_size`, `num_mp`, `mp_rank_str`, `get_model_parallel_rank`, files
`mp_rank_00_model_states.pt`) are not in MP_NAMES, and nothing else needs one."""


def _config_key_fields() -> frozenset[str]:
    """Field names of the config sections: DeepSpeed's JSON keys (`zero_optimization.stage`,
    `stage3_max_live_parameters`, `pipeline.stages`), kept as DeepSpeed spells them."""
    from zeroshard.config import schema

    out: set[str] = set()
    todo = [schema.Config]
    seen: set[type] = set()
    while todo:
        cls = todo.pop()
        if cls in seen or not dataclasses.is_dataclass(cls):
            continue
        seen.add(cls)
        for f in dataclasses.fields(cls):
            out.add(f.name)
        hints = typing.get_type_hints(cls)
        for tp in hints.values():
            for arg in (tp, *getattr(tp, "__args__", ())):
                if isinstance(arg, type) and dataclasses.is_dataclass(arg):
                    todo.append(arg)
    return frozenset(out)


def _bound_names(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, kind, identifier) for every identifier the module defines or passes by name: names
    (read or written), parameters, keyword arguments ("keyword to <callee>"), attributes assigned,
    functions, and class-body fields. Attributes only read are left out: they are other modules'."""
    out: list[tuple[int, str, str]] = []
    class_fields: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    class_fields.add(id(stmt.target))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.append((node.lineno, "field" if id(node) in class_fields else "name", node.id))
        elif isinstance(node, ast.arg):
            out.append((node.lineno, "parameter", node.arg))
        elif isinstance(node, ast.Call):
            callee = ast.unparse(node.func).rsplit(".", 1)[-1]
            out += [(k.lineno, f"keyword to {callee}", k.arg) for k in node.keywords if k.arg is not None]
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.append((node.lineno, "attribute", node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append((node.lineno, "function", node.name))
    return out


def _unqualified_stage(identifier: str) -> bool:
    """`identifier` has a word "stage"/"stages" (or "stage3", "stages12") not preceded by a word
    that says which stage (`STAGE_QUALIFIERS`)."""
    words = identifier.lower().strip("_").split("_")
    return any(re.fullmatch(r"stages?\d*", w) and (i == 0 or words[i - 1] not in STAGE_QUALIFIERS)
               for i, w in enumerate(words))


@functools.cache
def _sources() -> list[tuple[str, ast.Module]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        if ALIAS_TREE in path.parents:
            continue
        out.append((path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8"))))
    return out


def _is_pipeline_module(rel: str) -> bool:
    return any(rel == m or (m.endswith("/") and rel.startswith(m)) for m in PIPELINE_MODULES)


def _stage_misuses(sources: list[tuple[str, ast.Module]], json_keys: frozenset[str]) -> list[str]:
    wrong = []
    for rel, tree in sources:
        if _is_pipeline_module(rel):
            continue
        for line, kind, name in _bound_names(tree):
            if not _unqualified_stage(name) or (rel, name) in DEEPSPEED_STAGE_NAMES:
                continue
            # DeepSpeed's JSON keys: as the config sections' fields, and passed to one (`...Config(stage=3)`).
            if name in json_keys and ((kind == "field" and rel.startswith("config/schema"))
                                      or (kind.startswith("keyword") and kind.endswith("Config"))):
                continue
            wrong.append(f"{rel}:{line}: {kind} {name}")
    return wrong


def test_stage_is_the_pipeline_stage_and_the_zero_stage_is_zero_stage() -> None:
    """Outside the pipeline modules no identifier says "stage" without saying which (a ZeRO stage
    is `zero_stage`, `zero_stages`, `_zero_stage3`; a pipeline one `pp_...`/`pipeline_...`), but
    for DeepSpeed's JSON keys and the DeepSpeed names of DEEPSPEED_STAGE_NAMES."""
    wrong = _stage_misuses(_sources(), _config_key_fields())
    assert not wrong, ("identifiers that say 'stage' but not which (the ZeRO stage is zero_stage in code; "
                       f"a pipeline stage lives in PIPELINE_MODULES or says pp_/pipeline_): {wrong}")
    stale = [m for m in PIPELINE_MODULES if not (ROOT / m).exists()]
    assert not stale, f"PIPELINE_MODULES lists modules that no longer exist: {stale}"
    used = {(rel, name) for rel, tree in _sources() for _, _, name in _bound_names(tree)}
    unused = sorted(set(DEEPSPEED_STAGE_NAMES) - used)
    assert not unused, f"DEEPSPEED_STAGE_NAMES lists names no longer used there: {unused}"


def _is_zero_stage(value: ast.AST) -> bool:
    """`value` is the ZeRO stage read from a config (or `int()` of it, or it compared with a number):
    `<...>.zero_optimization.stage`, `zero.stage`, or a raw ds_config's
    `<...zero_optimization...>.get("stage")` / `["stage"]`."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "int" and value.args:
        return _is_zero_stage(value.args[0])
    if isinstance(value, ast.Compare):
        return _is_zero_stage(value.left)
    if isinstance(value, ast.Attribute) and value.attr == "stage":
        obj = ast.unparse(value.value)
        return obj == "zero" or obj.endswith("zero_optimization")
    if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "get"
            and value.args and isinstance(value.args[0], ast.Constant) and value.args[0].value == "stage"):
        return "zero_optimization" in ast.unparse(value.func.value)
    if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant) and value.slice.value == "stage":
        return "zero_optimization" in ast.unparse(value.value)
    return False


def _zero_stage_bindings(sources: list[tuple[str, ast.Module]]) -> list[str]:
    """Names bound to the ZeRO stage read from a config that do not say "zero"."""
    wrong = []
    for rel, tree in sources:
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            if not _is_zero_stage(value):
                continue
            for target in targets:
                for t in ast.walk(target):
                    name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
                    if name is not None and isinstance(getattr(t, "ctx", None), ast.Store) and "zero" not in name:
                        wrong.append(f"{rel}:{node.lineno}: {name} = {ast.unparse(value)[:80]}")
    return wrong


def test_the_zero_stage_read_from_a_config_is_named_zero_stage() -> None:
    """In every module, pipeline ones included, a name bound to `zero_optimization.stage` says
    "zero" (`zero_stage`, `zero3`): in a pipeline module a bare `stage` is the pipeline's."""
    wrong = _zero_stage_bindings(_sources())
    assert not wrong, f"the ZeRO stage bound to a name without 'zero' (call it zero_stage): {wrong}"


def _mp_misuses(sources: list[tuple[str, ast.Module]]) -> list[str]:
    return [f"{rel}:{line}: {kind} {name}" for rel, tree in sources for line, kind, name in _bound_names(tree)
            if name.lstrip("_") in MP_NAMES and (rel, name) not in DEEPSPEED_MP_NAMES]


def test_the_tensor_parallel_axis_is_tp_not_mp() -> None:
    wrong = _mp_misuses(_sources())
    assert not wrong, ("identifiers naming the tensor-parallel axis 'mp' (say tp, tp_size, tp_rank, tp_comm; "
                       f"or add a DeepSpeed-facing name to DEEPSPEED_MP_NAMES with the reason): {wrong}")
    stale = [f"{m}: {n}" for m, n in DEEPSPEED_MP_NAMES if not (ROOT / m).exists()]
    assert not stale, f"DEEPSPEED_MP_NAMES lists modules that no longer exist: {stale}"


@pytest.mark.parametrize(("source", "stage_hits", "binding_hits", "mp_hits"), [
    ("def f(stage): return stage", 2, 0, 0),
    ("stage3 = cfg.zero_optimization.stage == 3", 1, 1, 0),
    ("zero3 = cfg.zero_optimization.stage == 3", 0, 0, 0),
    ("x = Setup(stage=2)", 1, 0, 0),
    ("x = ZeroOptimizationConfig(stage=2)", 0, 0, 0),
    ("s = int((d.get('zero_optimization') or {}).get('stage', 0))", 0, 1, 0),
    ("def f(zero_stage, pp_stage_comm, zero_stages): pass", 0, 0, 0),
    ("def _stage12(mp_rank): self.mp = 1", 1, 0, 2),
])
def test_the_identifier_checks_catch_what_they_claim(source: str, stage_hits: int, binding_hits: int,
                                                     mp_hits: int) -> None:
    sources = [("zero/example.py", ast.parse(source))]
    keys = frozenset({"stage"})
    assert len(_stage_misuses(sources, keys)) == stage_hits
    assert len(_zero_stage_bindings(sources)) == binding_hits
    assert len(_mp_misuses(sources)) == mp_hits
