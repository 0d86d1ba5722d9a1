"""`engine.compile()`: torch.compile of the wrapped model, zeroshard's hooks and collectives kept eager,
and a count of what the compiler split or compiled again, said once and whenever it changes.

Without a pipeline the whole model is compiled in place; with one, each layer of this rank's stages
(Note: [compiling a pipeline's layers]). Imports nothing of zeroshard but `errors`, `pipe.module`,
`tensor_parallel.layers` and `runtime.engine_api` (for annotations only). torch._dynamo (2-4 s to
import) is loaded only when something compiles.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from zeroshard.errors import NotSupportedError
from zeroshard.pipe.module import PipelineModule
from zeroshard.tensor_parallel.layers import keep_collectives_eager

if TYPE_CHECKING:
    from zeroshard.runtime.engine_api import EngineView

logger = logging.getLogger("zeroshard")

_FALLBACK = "recompile limit"
"""Dynamo's reason when a frame hit its recompile limit and runs eagerly from then on."""


@dataclass
class CompileStats:
    """What torch.compile made of the model so far (`engine.compile_stats`).

    Counted from `torch._dynamo.utils.counters` around each call of the compiled model, so code the
    model itself compiles is counted with it, and code Dynamo already traced for an earlier engine
    of the same classes in this process (reused from its cache) is not counted again.
    """

    backend: str
    """The backend's name (a callable's `__name__`)."""
    graphs: int = 0
    """Graphs compiled for the model: one per region between graph breaks, plus recompiles."""
    graph_breaks: int = 0
    """Graph breaks Dynamo reported while tracing the model (at ZeRO stage 3, two per unit:
    its gather and release hooks run eagerly; Note: [hooks under torch.compile] in zero/stage3.py)."""
    break_reasons: Counter[str] = field(default_factory=Counter)
    """Each graph break's reason (Dynamo's first line and the function it names) -> count."""
    recompiles: int = 0
    """Graphs compiled after the first forward (new input shapes, grad mode, ...)."""
    first_forward_s: float | None = None
    """Wall time of the first compiled forward: tracing and compiling the forward and backward graphs
    (with a pipeline: the first calls of all its compiled layers, summed)."""
    forwards: int = 0
    """Calls of the compiled model (with a pipeline: of the stage's first compiled layer, once per
    micro-batch, and once more for torch's shape inference on the first batch)."""
    regions: int = 1
    """Callables compiled on their own: 1 (the model), or the layers of this rank's pipeline stages."""
    regions_run: int = 0
    """Regions called at least once (their first call compiled them)."""

    def summary(self) -> str:
        """One line: graphs, breaks and their reasons, compile time."""
        reasons = "; ".join(f"{n} x {r}" for r, n in sorted(self.break_reasons.items()))
        took = f" in {self.first_forward_s:.1f} s" if self.first_forward_s is not None else ""
        return (f"backend {self.backend}: {self.graphs} graph(s), {self.graph_breaks} graph break(s){took}"
                + (f" ({reasons})" if reasons else "") + (f", {self.recompiles} recompiled" if self.recompiles else ""))


def _short(reason: str) -> str:
    """Dynamo's graph-break reason in one line: its first line and the first function it names."""
    head, _, rest = reason.strip().partition("\n")
    named = re.search(r"<function (\S+) at 0x", reason) or re.search(r"`([^`]+)`", rest)
    return f"{head or 'unknown'} ({named.group(1)})" if named else head or "unknown"


class CompiledCall:
    """The model's compiled call: torch.compile's function, plus the accounting in `CompileStats`.

    Installed as the module's `_compiled_call_impl` (what `nn.Module.compile` sets), so the engine's
    forward, `engine.module(...)` and generation all run the compiled model.
    """

    def __init__(self, compiled: Callable[..., Any], stats: CompileStats, *, counts_forwards: bool = True) -> None:
        from torch._dynamo.utils import counters

        self._compiled = compiled
        self._counters = counters
        self.stats = stats
        self._counts_forwards = counts_forwards
        self._ran = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        graphs, breaks = self._counters["stats"]["unique_graphs"], Counter(self._counters["graph_break"])
        start = time.perf_counter()
        out = self._compiled(*args, **kwargs)
        self._account(graphs, breaks, time.perf_counter() - start)
        return out

    def _account(self, graphs_before: int, breaks_before: Counter[str], took_s: float) -> None:
        stats = self.stats
        stats.forwards += self._counts_forwards
        new_graphs = self._counters["stats"]["unique_graphs"] - graphs_before
        new_breaks = Counter(self._counters["graph_break"])
        new_breaks.subtract(breaks_before)
        reasons: Counter[str] = Counter()
        for reason, n in new_breaks.items():
            if n > 0:
                reasons[_short(reason)] += n
        stats.graphs += new_graphs
        stats.graph_breaks += sum(reasons.values())
        stats.break_reasons.update(reasons)
        if not self._ran:  # this region's first call compiled it
            self._ran = True
            stats.first_forward_s = (stats.first_forward_s or 0.0) + took_s
            stats.regions_run += 1
            if stats.regions_run == stats.regions:
                logger.info(f"engine.compile: first forward compiled, {stats.summary()}")
            return
        stats.recompiles += new_graphs
        fallback = [r for r in reasons if _FALLBACK in r.lower()]
        if fallback:
            logger.warning(f"engine.compile: Dynamo hit its recompile limit at forward {stats.forwards}; that "
                           f"part of the model now runs eagerly: {'; '.join(fallback)}. Raise the limit with "
                           "compile_kwargs={'recompile_limit': N}, or find the cause with "
                           "TORCH_LOGS=recompiles.")
        elif reasons:
            logger.warning(f"engine.compile: {sum(reasons.values())} new graph break(s) at forward "
                           f"{stats.forwards}: {'; '.join(reasons)}")
        elif new_graphs:
            logger.info(f"engine.compile: forward {stats.forwards} compiled {new_graphs} more graph(s) "
                        "(a new input shape or grad mode; TORCH_LOGS=recompiles says why)")


def _refuse(engine: "EngineView", schedule: Any, compiled_autograd_enabled: bool) -> None:
    """The combinations engine.compile() does not build, refused by name before anything changes."""
    if schedule is not None:
        raise NotSupportedError(
            "engine.compile(schedule=...) is not supported: the schedule orders DeepCompile's passes, and "
            "DeepCompile (compile.deepcompile) is not implemented. Leave schedule=None; the model is "
            "compiled with torch.compile and zeroshard's ZeRO hooks stay eager.")
    if compiled_autograd_enabled:
        raise NotSupportedError(
            "engine.compile(compiled_autograd_enabled=True) is not supported yet: compiled autograd would "
            "trace zeroshard's gradient hooks (bucketed reduce / reduce-scatter into the gradient shards) "
            "into the backward graph. Leave it False: the backward still runs AOTAutograd's compiled graphs, "
            "with the gradient hooks eager between them.")
    parallel = engine.parallel
    if engine.mp_world_size > 1 and (parallel is None or parallel.tp is None):
        raise NotSupportedError(
            f"engine.compile() with model-parallel layers of your own (an mpu, or a PipelineModule topology "
            f"with a model axis; model-parallel size {engine.mp_world_size}) is not supported yet: their "
            "collectives are not zeroshard's, so they cannot be kept out of the compiled graphs. Compile with "
            "AutoTP (tensor_parallel.autotp_size) instead, or train eagerly.")


def _has_own_code(module: nn.Module) -> bool:
    """Whether some forward in `module` is not torch's own: Dynamo skips frames in torch's files, so a
    torch.nn layer alone (nn.Linear, nn.Embedding, a Sequential of them) runs eagerly even when
    compiled, and compiling it would only count a region that never gets a graph."""
    return any(not type(m).forward.__module__.startswith("torch.") for m in module.modules())


def _backend_name(backend: str | Callable[..., Any]) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)


def compile_model(engine: "EngineView", backend: str | Callable[..., Any], compile_kwargs: Mapping[str, Any],
                  schedule: Any, compiled_autograd_enabled: bool) -> CompileStats:
    """Compile `engine.module` in place (as DeepSpeed's `module.compile(...)`); see `ZeroEngine.compile`.

    Returns:
        The `CompileStats` the compiled call fills in.

    Raises:
        NotSupportedError: a DeepCompile schedule, compiled autograd, or an mpu's model parallelism.
    """
    _refuse(engine, schedule, compiled_autograd_enabled)
    import torch
    import torch._dynamo  # optional at run time: only engines that compile import it

    kwargs = dict(compile_kwargs)
    if "backend" in kwargs:
        logger.warning("engine.compile: the `backend` in compile_kwargs is overridden by the `backend` "
                       "argument (as in DeepSpeed); pass it as backend=...")
        del kwargs["backend"]
    if torch._dynamo.config.suppress_errors:
        logger.warning("engine.compile: torch._dynamo.config.suppress_errors is True, so a compile error "
                       "falls back to eager with only Dynamo's own log line; set it to False to see errors.")
    engine.strategy.keep_hooks_eager()  # Note: [hooks under torch.compile] in zero/stage3.py
    keep_collectives_eager()  # Note: [TP collectives under torch.compile] in tensor_parallel/layers.py
    module: nn.Module = engine.module
    stats = CompileStats(backend=_backend_name(backend))
    if isinstance(module, PipelineModule):
        # Note: [compiling a pipeline's layers] torch's pipeline schedule calls the stage (pipe/module.py's
        # chunks) between its sends and receives, and the stage seeds each layer's random generators
        # from Python (`seed_layers`) and may checkpoint ranges of layers: compiling the stage's
        # forward would trace or break at all of that. Each layer is compiled on its own instead
        # (as nn.Module.compile does, in place); the schedule, its p2p transfers, the seeding, the
        # recompute and the loss stay eager around them. Layers of one class share their graphs.
        first = True

        def compile_one(fn: Callable[..., Any]) -> Callable[..., Any]:
            nonlocal first
            call = CompiledCall(torch.compile(fn, backend=backend, **kwargs), stats, counts_forwards=first)
            first = False
            return call

        stats.regions, left = module.compile_layers(compile_one, _has_own_code)
        what = f"{stats.regions} layer(s) of this rank's pipeline stage(s)"
        if left:
            what += (f" (left eager: {', '.join(left)}, torch.nn modules with no code of the script's, which "
                     "Dynamo does not compile)")
    else:
        module.compile(backend=backend, **kwargs)
        compiled = getattr(module, "_compiled_call_impl", None)
        if compiled is None:
            raise AssertionError("expected nn.Module.compile to set _compiled_call_impl, got None")
        module._compiled_call_impl = CompiledCall(compiled, stats)
        what = "the model"
    logger.info(f"engine.compile: compiling {what} with backend {stats.backend}"
                + (f", {kwargs}" if kwargs else "") + " on the first forward")
    if not stats.regions or not _has_own_code(module):
        logger.warning("engine.compile: the model has no forward of the script's, only torch.nn modules, which "
                       "Dynamo does not compile: it runs eagerly.")
    return stats
