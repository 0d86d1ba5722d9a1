"""Every module docstring's claim about its imports holds for the code (STYLE §1 and §6: a module
opens with its responsibility and what it must not import), checked against the module's real
imports (module level, `TYPE_CHECKING` blocks and functions alike).

A claim is a sentence of the module docstring that starts with "Imports" (or a clause that starts
with "; imports" / ": imports"):
- "Imports nothing of ours [but A, B and C]" / "Imports only A and B" / "Imports A and B only" /
  "Imports A, B": every zeroshard module the code imports is one of those named (or in the
  module's own package); "at import time" limits the claim to module-level imports.
- every zeroshard module named in a claim is imported, so a claim never outlives the code;
- "never X" / "neither X nor Y" / "must not import X" in a claim: X is not imported.
Names are written as dotted paths (`zeroshard.errors`, `estimate.spec`), file paths
(`zero/offload/nvme_io.py`, `runtime/`) or bare package names (`errors`, `config`).
config/'s own rule (imports nothing but `errors`) is tests/unit/test_config_docs.py's.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "zeroshard"
SKIP = ("compat/alias/",)  # DeepSpeed's tree, mirrored name for name; its modules make no claims


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(ROOT.rglob("*.py")) if not any(s in str(p) for s in SKIP)}
THIRD_PARTY = {"torch", "transformers", "safetensors", "numpy", "deepspeed", "tqdm", "hjson"}


@dataclass
class Imports:
    module_level: set[str] = field(default_factory=set)
    anywhere: set[str] = field(default_factory=set)


def real_imports(path: Path) -> Imports:
    """Every imported module path (for `from a.b import c`: a.b and a.b.c); module level means at
    import time (not in a function, not under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = Imports()
    deferred = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                or (isinstance(f, ast.If) and "TYPE_CHECKING" in ast.unparse(f.test)) for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        else:
            continue
        found.anywhere |= names
        if id(node) not in deferred:
            found.module_level |= names
    return found


_SENTENCE_END = re.compile(r"\.(?=\s+[A-Z(`*]|\s*$)")
_CLAIM_START = re.compile(r"(?:^|[.;:]\s+)([Ii]mports\s)")
_TOKEN = re.compile(r"`{1,2}([^`]+)`{1,2}|([A-Za-z_][\w.*/-]*)")


def claims(doc: str) -> list[str]:
    """The import-claim sentences of a docstring, whitespace-normalised."""
    flat = " ".join(doc.split())
    out = []
    for m in _CLAIM_START.finditer(flat):
        rest = flat[m.start(1):]
        end = _SENTENCE_END.search(rest)
        sentence = rest[: end.start()] if end else rest
        clauses = sentence.split("; ")
        out.append("; ".join([clauses[0], *(c for c in clauses[1:] if c.startswith("never") or "lazily" in c)]))
    out += [m.group(0) for m in re.finditer(r"must not import [^.;]+", flat)]
    return out


def resolve(word: str, package: str = "zeroshard") -> str | None:
    """A word of a claim as a zeroshard module path (absolute, or relative to zeroshard or to the
    claiming module's package), or None when it names none."""
    word = word.strip().rstrip(",;:)").removesuffix(".py").replace("/", ".").strip(".")
    word = word.split(" ")[0].removesuffix("-level").removesuffix("'s")
    if word.endswith("*"):  # `zeroshard.cli.launch_*`: every module of that prefix
        prefix = word[:-1] if word.startswith("zeroshard") else f"zeroshard.{word[:-1]}"
        return prefix if any(m.startswith(prefix) for m in MODULES) else None
    for candidate in (word, f"zeroshard.{word}", f"{package}.{word}"):
        if candidate in MODULES:
            return candidate
    return None


AMBIENT = {"zeroshard.errors", "zeroshard.progress"}
"""Allowed everywhere without being named: every layer raises zeroshard's errors (STYLE §5) and
may report progress (progress.py imports nothing of ours)."""


@dataclass
class Claim:
    text: str
    allowed: set[str] | None  # None: the claim does not limit what is imported
    named: set[str]
    forbidden: set[str]
    import_time_only: bool
    deferred: set[str]  # "X only inside functions": X is not imported at import time


def _words(text: str) -> list[str]:
    return [m.group(1) or m.group(2) for m in _TOKEN.finditer(text)]


def parse(text: str, module: str) -> Claim:
    """Read one claim sentence of `module`'s docstring."""
    body = re.sub(r"^[Ii]mports\s+", "", text)
    negative = ""
    for marker in (" never ", " neither ", "must not import "):
        if marker in f" {body}":
            body, _, negative = f" {body}".partition(marker)
            body = body.strip()
            break
    forbidden = {r for w in _words(re.sub(r"\(.*?\)", "", negative))
                 if (r := resolve(w) or (w if w in THIRD_PARTY | {"torch.distributed"} else None))}
    deferred: set[str] = set()
    if re.search(r"only (inside|in) functions", body):
        deferred = {w for w in _words(body) if w in THIRD_PARTY or resolve(w)}
        return Claim(text, None, set(), forbidden, False, deferred)
    named = set()
    for word in _words(body):
        if word in ("zeroshard", "ours", "zeroshard's") and not body.startswith(f"`{word}`"):
            continue  # "nothing of zeroshard", "nothing of ours"
        if (r := resolve(word, module.rpartition(".")[0])) is not None:
            named.add(r)
    exclusive = bool(body) and not negative.strip() or bool(body.strip(" ,"))
    return Claim(text, set(named) if exclusive else None, named, forbidden, "at import time" in body, deferred)


def _covered(name: str, modules: set[str]) -> bool:
    """`name` is one of `modules` or inside one (a name ending in "_" is a prefix: launch_*)."""
    return any(name == m or name.startswith(f"{m}." if not m.endswith("_") else m) for m in modules)


def _claims_of(module: str) -> list[tuple[str, str]]:
    doc = ast.get_docstring(ast.parse(MODULES[module].read_text(encoding="utf-8"))) or ""
    return [(module, c) for c in claims(doc)]


CLAIMS = [c for m in MODULES for c in _claims_of(m)]


def _scope(module: str) -> list[str]:
    """A package's docstring speaks for the whole package; a module's for itself."""
    if MODULES[module].name != "__init__.py":
        return [module]
    return [m for m in MODULES if m == module or m.startswith(f"{module}.")]


def test_claims_are_found() -> None:
    """The parser still reads the house style: most modules state their imports."""
    assert len(CLAIMS) >= 60, [c for _, c in CLAIMS]


@pytest.mark.parametrize(("module", "text"), CLAIMS, ids=[m.removeprefix("zeroshard.") for m, _ in CLAIMS])
def test_import_claim_holds(module: str, text: str) -> None:
    claim = parse(text, module)
    scope = _scope(module)
    found = [real_imports(MODULES[m]) for m in scope]
    anywhere = set().union(*(f.anywhere for f in found))
    imported = set().union(*(f.module_level if claim.import_time_only else f.anywhere for f in found))
    if claim.allowed is not None:
        own = {module} if len(scope) > 1 else set()  # a package's modules import each other
        ours = {i for i in imported if i == "zeroshard" or i.startswith("zeroshard.")}
        extra = sorted(i for i in ours if not _covered(i, claim.allowed | AMBIENT | own))
        assert not extra, f"{module}: docstring says {claim.text!r}, but the code imports {extra}"
    stale = sorted(n for n in claim.named if not any(_covered(i, {n}) for i in anywhere))
    assert not stale, f"{module}: docstring says {claim.text!r}, but the code does not import {stale}"
    broken = sorted(f for f in claim.forbidden if any(_covered(i, {f}) for i in anywhere))
    assert not broken, f"{module}: docstring says {claim.text!r}, but the code imports {broken}"
    eager = sorted(d for d in claim.deferred if any(_covered(i, {d}) for f in found for i in f.module_level))
    assert not eager, f"{module}: docstring says {claim.text!r}, but {eager} is imported at import time"


def test_the_parser_reads_the_forms_in_use() -> None:
    """The test can fail: each form yields the names a wrong import would be checked against."""
    gather = parse("Imports nothing of ours but `comm/codecs.py` (and `comm` for types)", "zeroshard.zero.gather")
    assert gather.named == {"zeroshard.comm.codecs", "zeroshard.comm"} and gather.allowed == gather.named
    env = parse("Imports nothing of ours but ``errors``; never torch.distributed", "zeroshard.comm.env")
    assert env.named == {"zeroshard.errors"} and env.forbidden == {"torch.distributed"}
    pure = parse("Imports nothing of ours", "zeroshard.comm.log")
    assert pure.allowed == set() and not pure.import_time_only
    optim = parse("Imports neither runtime/ nor checkpoint/", "zeroshard.optim")
    assert optim.forbidden == {"zeroshard.runtime", "zeroshard.checkpoint"}
    lazy = parse("Imports transformers and safetensors only inside functions", "zeroshard.compat.hf_loading")
    assert lazy.allowed is None and lazy.deferred == {"transformers", "safetensors"}


def _edges(module: str) -> set[str]:
    """The zeroshard modules `module` needs at run time (not under TYPE_CHECKING): for
    `from a import b`, a.b when that is a module, else a."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    typing_only = {id(n) for f in ast.walk(tree) if isinstance(f, ast.If) and "TYPE_CHECKING" in ast.unparse(f.test)
                   for n in ast.walk(f)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module in MODULES and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            out |= subs if len(subs) == len(node.names) else {node.module, *subs}
    return out - {module}


def test_no_import_cycles() -> None:
    """No two modules need each other (in-function imports included: STYLE §1 keeps those for
    optional dependencies, not for hiding a cycle, as estimate/spec.py <-> hf_count.py once did)."""
    graph = {m: _edges(m) for m in MODULES}
    cycles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles))[:10])


LAYERS: dict[str, int] = {
    # 0: no layer of ours below them
    "errors": 0, "progress": 0, "arguments": 0, "checkpoint_format": 0, "config": 0, "flops_profiler": 0,
    "comm": 1,  # the only importer of torch.distributed
    "accelerator": 2, "activation_checkpointing": 2, "optim": 2, "zero": 2, "sequence": 2, "moe": 2,
    "tensor_parallel": 3, "pipe": 3,  # model parallelism over zero/'s strategies and comm/'s groups
    "runtime": 4,
    "checkpoint": 5, "utils": 5,
    "examples": 6, "estimate": 6,
    "cli": 7, "compat": 7, "zeroshard": 7,
}
"""DESIGN.md's layers as package ranks: a module imports only packages of a lower rank (or its own)."""

COMPOSITION_ROOT: dict[tuple[str, str], str] = {
    ("zeroshard.runtime.initialize", "zeroshard.checkpoint"):
        "initialize() composes the engine with a Checkpointer; in functions only, so the engine and the rest of "
        "runtime/ never import the checkpoint layer",
}
"""Upward imports allowed, each with its reason (and each must still exist)."""


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _all_edges(module: str) -> set[str]:
    """Every zeroshard module `module` names in an import (functions and TYPE_CHECKING included)."""
    return {i for i in real_imports(MODULES[module]).anywhere if i in MODULES} - {module}


def test_every_package_has_a_layer() -> None:
    assert {_package(m) for m in MODULES} <= LAYERS.keys(), sorted({_package(m) for m in MODULES} - LAYERS.keys())


def test_no_upward_imports() -> None:
    """No module imports a higher layer (type-only imports included: a type is a dependency too),
    outside the composition roots listed with their reasons."""
    upward, used = [], set()
    for module in MODULES:
        mine = LAYERS[_package(module)]
        for dep in _all_edges(module):
            if LAYERS[_package(dep)] <= mine:
                continue
            root = next((k for k in COMPOSITION_ROOT if module == k[0] and _covered(dep, {k[1]})), None)
            if root is None:
                upward.append(f"{module} -> {dep}")
            else:
                used.add(root)
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))
    assert used == COMPOSITION_ROOT.keys(), f"stale composition roots: {sorted(COMPOSITION_ROOT.keys() - used)}"


def test_no_type_level_cycles() -> None:
    """No two modules name each other in imports, even for types only (TYPE_CHECKING): a helper that
    needs the engine's type reads a protocol (runtime/engine_api.py) instead."""
    graph = {m: _all_edges(m) for m in MODULES}
    pairs = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if a < b and a in graph.get(b, ()))
    assert not pairs, "modules that import each other:\n" + "\n".join(pairs)
