"""`PipelineModule`, `LayerSpec`, `TiedLayerSpec`: a model as a list of layers cut into stages.

DeepSpeed's `deepspeed.pipe` API. Each rank builds only its stage's layers, registered under
their global layer index (`"3.weight"`), tied layers once under `tied_modules.<key>`, so names
do not depend on the stage count. The schedule (runtime/pipe_engine.py) runs the stage through
`chunks()`, one module per stage this rank holds. Imports comm/ and pipe/ only, and
activation_checkpointing (DeepSpeed's `activation_checkpoint_func` default).
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from zeroshard.activation_checkpointing import checkpoint as _default_checkpoint
from zeroshard.activation_checkpointing import non_reentrant_checkpoint
from zeroshard.comm.groups import init_distributed
from zeroshard.comm.parallel_dims import PipeShape
from zeroshard.comm.topology import Topology
from zeroshard.errors import ConfigError, NotSupportedError
from zeroshard.pipe.grid import PipelineParallelGrid
from zeroshard.pipe.partition import partition_min_max, partition_spread, partition_uniform
from zeroshard.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology

logger = logging.getLogger("zeroshard")


class PipelineError(Exception):
    """Errors related to the use of the pipeline engine (DeepSpeed's name)."""


class LayerSpec:
    """A layer to build later, on the stage that owns it: `LayerSpec(nn.Linear, 4, 8, bias=False)`.

    Raises:
        TypeError: `typename` is not an nn.Module subclass.
    """

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec only builds torch.nn.Module types, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log: bool = False) -> nn.Module:
        """Build the layer."""
        if log:
            logger.info(f"building {self!r}")
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose weights (`tied_weight_attr`) are shared by every TiedLayerSpec with the same
    `key`, on whichever stages they land (an embedding reused as the output head).

    `forward_fn(module, x)` replaces the module's forward at this position when given.
    """

    def __init__(self, key: str, typename: type[nn.Module], *module_args: Any,
                 forward_fn: Callable[..., Any] | None = None, tied_weight_attr: Sequence[str] | str = ["weight"],
                 **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def _set_random_seed(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % (2**32))
    except ImportError:
        pass
    torch.manual_seed(seed)


def _layer_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return layer.__class__.__name__
    return getattr(layer, "__name__", "")  # DeepSpeed skips a layer without a name in `type:` matching


def count_layer_params(layers: Sequence[Any]) -> list[int]:
    """Trainable parameters per layer; LayerSpecs are built on the meta device (no memory, no
    random numbers drawn; DeepSpeed builds each for real, on every rank)."""
    counts = []
    for layer in layers:
        if isinstance(layer, LayerSpec):
            with torch.device("meta"):
                layer = layer.build()
        if isinstance(layer, nn.Module):
            counts.append(sum(p.numel() for p in layer.parameters() if p.requires_grad))
        else:
            counts.append(0)
    return counts


def partition_layers(layers: Sequence[Any], method: str, num_parts: int) -> list[int]:
    """Stage boundaries for `partition_method` (see PipelineModule): `parts[s]:parts[s + 1]`.

    Raises:
        ConfigError: an unknown method, or a `type:` regex no layer matches.
    """
    name = method.lower()
    if name == "uniform":
        return partition_uniform(len(layers), num_parts)
    if name == "parameters":
        return partition_spread(count_layer_params(layers), num_parts)
    if name == "balanced":
        return partition_min_max(count_layer_params(layers), num_parts)
    if name.startswith("type:"):
        regex = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        hits = [1 if regex.search(_layer_name(layer)) else 0 for layer in layers]
        if not any(hits):
            raise ConfigError(f"partition_method={method!r}: no layer's type matches; layer types are "
                              f"{sorted({_layer_name(x) for x in layers})}")
        return partition_spread(hits, num_parts)
    raise ConfigError(f"partition_method={method!r}: expected 'parameters', 'uniform', 'type:<regex>' "
                      "or 'balanced'")


class _Chunk(nn.Module):
    """One stage this rank runs: its layers as children (torch's PipelineStage reads their
    parameters for the weight-gradient split), its forward the owner's `run_chunk`."""

    def __init__(self, owner: PipelineModule, index: int, modules: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(modules)
        self._run = partial(owner.run_chunk, index)

    def forward(self, *inputs: Any) -> Any:
        return self._run(inputs[0] if len(inputs) == 1 else inputs)


class PipelineModule(nn.Module):
    """A sequence of layers executed as a pipeline, as DeepSpeed's `PipelineModule`.

    Args:
        layers: `LayerSpec`s, `TiedLayerSpec`s, modules or callables, applied in order; each
            layer's output is the next one's input.
        num_stages: pipeline stages; the world size must be a multiple (the rest is data
            parallelism). Give this or `topology`.
        topology: a `PipeDataParallelTopology` / `PipeModelDataParallelTopology` instead.
        loss_fn: `loss_fn(outputs, labels)` on the last stage.
        seed_layers: seed the random generators with `base_seed + layer index` before building
            each layer (layers are initialised the same whatever the stage count).
        seed_fn: the seeding function for `seed_layers` (default: random, numpy and torch).
        base_seed: see `seed_layers`.
        partition_method: "parameters" (default), "uniform", "type:<regex>" (DeepSpeed's exact
            boundaries), or zeroshard's "balanced" (non-empty stages, the heaviest as light as
            possible by parameter count).
        activation_checkpoint_interval: recompute every this many layers in backward; 0 = off.
        activation_checkpoint_func: the checkpoint function (`zeroshard.checkpointing.checkpoint`).
        checkpointable_layers: class names eligible for activation checkpointing (default: any
            layer with parameters).
        dynamic_shape: activations may change shape between batches (shapes are agreed anew).
        virtual_stages: zeroshard's extension: stages per rank for the interleaved schedules
            (`pipeline.schedule` in the config); rank r runs stages r, r + p, r + 2p, ...

    Raises:
        ConfigError: neither num_stages nor topology, a world size num_stages does not divide,
            or an unknown partition method.
    """

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None, topology: ProcessTopology | None = None,
                 loss_fn: Callable[..., Tensor] | None = None, seed_layers: bool = False,
                 seed_fn: Callable[[int], None] | None = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable[..., Any] = _default_checkpoint,
                 checkpointable_layers: list[str] | None = None, dynamic_shape: bool = False, *,
                 virtual_stages: int = 1) -> None:
        super().__init__()
        if num_stages is None and topology is None:
            raise ConfigError("PipelineModule needs num_stages= or topology=")
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise ConfigError(f"PipelineModule(checkpointable_layers=...) must be a list of class names, "
                              f"got {type(checkpointable_layers).__name__}")
        if virtual_stages < 1:
            raise ConfigError(f"PipelineModule(virtual_stages={virtual_stages}): expected >= 1")
        groups = init_distributed()
        self.global_rank, self.world_size = groups.rank, groups.world_size
        if topology is None:
            if self.world_size % num_stages:  # type: ignore[operator]
                raise ConfigError(f"num_stages ({num_stages}) must divide the world size ({self.world_size})")
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=self.world_size // num_stages)  # type: ignore[operator]
        self._topo = topology
        self.mesh_topology: Topology = topology.as_topology()
        if self.mesh_topology.world_size != self.world_size:
            raise ConfigError(f"the topology has {self.mesh_topology.world_size} ranks, the job {self.world_size}")
        self.virtual_stages = virtual_stages
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self._layer_specs = list(layers)
        # Layers given as modules are counted now: AutoTP later splits them in place, on their own stage only,
        # and the partition summary would mix this rank's pieces with other stages' whole layers
        self._module_param_counts = {i: sum(p.numel() for p in x.parameters() if p.requires_grad)
                                     for i, x in enumerate(self._layer_specs) if isinstance(x, nn.Module)}
        self.parts = self._partition(partition_method, self.num_stages * virtual_stages)
        self.partition_method = partition_method
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        # Stages (chunks) this rank runs, in schedule order: stage_id, stage_id + p, ...
        self.local_chunks = [self.stage_id + k * self.num_stages for k in range(virtual_stages)]
        self._funcs: dict[int, list[Any]] = {}
        self._micro_offset: dict[int, int] = {}
        for c in self.local_chunks:
            self._funcs[c] = self._build(self.parts[c], self.parts[c + 1])
            self._micro_offset[c] = 0
        self._local_start, self._local_stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        self._chunk_modules = [_Chunk(self, k, self._chunk_layer_modules(c)) for k, c in enumerate(self.local_chunks)]

    # -- building ---------------------------------------------------------------------------

    def _partition(self, method: str, num_parts: int) -> list[int]:
        return partition_layers(self._layer_specs, method, num_parts)

    def _count_layer_params(self) -> list[int]:
        """Whole parameters per layer (a module layer's as at construction, before any tensor-parallel split)."""
        counts = count_layer_params([None if isinstance(x, nn.Module) else x for x in self._layer_specs])
        return [self._module_param_counts.get(i, n) for i, n in enumerate(counts)]

    def _build(self, start: int, stop: int) -> list[Any]:
        funcs: list[Any] = []
        for idx in range(start, stop):
            layer = self._layer_specs[idx]
            if self.seed_layers:
                (self.seed_fn or _set_random_seed)(self.base_seed + idx)
            if isinstance(layer, PipelineModule):
                raise NotSupportedError("a PipelineModule inside a PipelineModule's layers is not supported")
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
            elif isinstance(layer, (LayerSpec, nn.Module)):
                module = layer.build() if isinstance(layer, LayerSpec) else layer
                self.add_module(str(idx), module)
                funcs.append(module)
            else:
                funcs.append(layer)  # a function (e.g. a lambda): called as is
        return funcs

    def _chunk_layer_modules(self, chunk: int) -> list[nn.Module]:
        out: dict[int, nn.Module] = {}
        for f in self._funcs[chunk]:
            module = f.args[0] if isinstance(f, partial) and f.args and isinstance(f.args[0], nn.Module) else f
            if isinstance(module, nn.Module):
                out.setdefault(id(module), module)
        return list(out.values())

    # -- running ----------------------------------------------------------------------------

    def chunks(self) -> list[nn.Module]:
        """One module per stage this rank runs (schedule order), for torch's PipelineStage."""
        return list(self._chunk_modules)

    def forward(self, forward_input: Any) -> Any:
        """Run every layer this rank holds, in order (the whole model on a single stage)."""
        x = forward_input
        for k in range(len(self.local_chunks)):
            x = self.run_chunk(k, x)
        return x

    def run_chunk(self, index: int, x: Any) -> Any:
        """Run local stage `index` (position in `local_chunks`) on `x`, checkpointing every
        `activation_checkpoint_interval` layers."""
        chunk = self.local_chunks[index]
        funcs = self._funcs[chunk]
        self._micro_offset[chunk] += 1
        start_layer = self.parts[chunk]
        interval = self.activation_checkpoint_interval
        if interval <= 0:
            return self._range_func(funcs, start_layer, 0, len(funcs), self._micro_offset[chunk])(x)
        for lo in range(0, len(funcs), interval):
            hi = min(lo + interval, len(funcs))
            run = self._range_func(funcs, start_layer, lo, hi, self._micro_offset[chunk])
            args = x if isinstance(x, tuple) else (x,)
            if not self._is_checkpointable(funcs[lo:hi]):
                x = run(*args)
            elif self.activation_checkpoint_func is not non_reentrant_checkpoint and not any(
                    isinstance(a, Tensor) and a.requires_grad for a in args):
                # A reentrant recompute only backpropagates into the region when an input needs
                # a gradient (DeepSpeed's first backward fails on token ids): give it one.
                anchor = torch.ones((), requires_grad=True)
                x = self.activation_checkpoint_func(lambda *a, r=run: r(*a[:-1]), *args, anchor)
            else:
                x = self.activation_checkpoint_func(run, *args)
        return x

    def _range_func(self, funcs: list[Any], start_layer: int, lo: int, hi: int, offset: int) -> Callable[..., Any]:
        def run(*inputs: Any) -> Any:
            x = inputs[0] if len(inputs) == 1 else inputs
            for i, layer in enumerate(funcs[lo:hi]):
                if self.seed_layers:
                    # DeepSpeed's seed: the layer's index within the checkpointed range, plus the stage start
                    (self.seed_fn or _set_random_seed)(self.base_seed * (offset + 1) + start_layer + i)
                x = layer(x)
            return x
        return run

    def compile_layers(self, compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]],
                       eligible: Callable[[nn.Module], bool]) -> tuple[int, list[str]]:
        """Compile each layer this rank runs, in place (Note: [compiling a pipeline's layers] in
        runtime/compile.py): a module's call becomes `compile_fn(module._call_impl)` (what
        `nn.Module.compile` sets, hooks included), a tied layer's `forward_fn` is replaced by
        `compile_fn` of it; a module used by several layers is compiled once. Modules `eligible`
        refuses and plain functions (lambdas between layers) stay eager.

        Returns:
            The number of callables compiled, and the modules left eager ("<layer index>:<class>").
        """
        done: set[int] = set()
        left: list[str] = []
        for chunk in self.local_chunks:
            funcs = self._funcs[chunk]
            for i, f in enumerate(funcs):
                if isinstance(f, nn.Module) and id(f) not in done:
                    done.add(id(f))
                    if eligible(f):
                        f._compiled_call_impl = compile_fn(f._call_impl)
                    else:
                        left.append(f"{self.parts[chunk] + i}:{type(f).__name__}")
                elif isinstance(f, partial) and f.args and isinstance(f.args[0], nn.Module):
                    funcs[i] = compile_fn(f)  # a TiedLayerSpec's forward_fn on its module
                    done.add(id(funcs[i]))
        return len(done) - len(left), left

    def _is_checkpointable(self, funcs: list[Any]) -> bool:
        if self.checkpointable_layers is not None:
            return all(f.__class__.__name__ in self.checkpointable_layers for f in funcs)
        return any(any(True for _ in f.parameters()) for f in funcs if isinstance(f, nn.Module))

    def set_checkpoint_interval(self, interval: int) -> None:
        if interval < 0:
            raise ConfigError(f"activation checkpoint interval must be >= 0, got {interval}")
        self.activation_checkpoint_interval = interval

    # -- queries (DeepSpeed's) --------------------------------------------------------------

    def partitions(self) -> list[int]:
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        """The stage (chunk) that owns global layer `layer_idx`."""
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer {layer_idx} is outside the model's {self._num_layers} layers")
        return next(s for s in range(len(self.parts) - 1) if self.parts[s] <= layer_idx < self.parts[s + 1])

    def topology(self) -> ProcessTopology:
        return self._topo

    @property
    def _grid(self) -> PipelineParallelGrid:
        """DeepSpeed's `PipelineModule._grid`: the grid of the current topology, over the engine's groups
        once `initialize` has built them (building them itself, on every rank, when read before)."""
        grid = self.__dict__.get("_grid_view")
        if grid is None or grid.topology() is not self._topo:
            grid = self.__dict__["_grid_view"] = PipelineParallelGrid(self._topo)
        return grid

    def mpu(self) -> PipelineParallelGrid:
        """The grid as a Megatron-style model-parallel unit (DeepSpeed's `PipelineModule.mpu()`)."""
        return self._grid

    # -- 3D parallelism (runtime/initialize.py) ---------------------------------------------

    @property
    def shape(self) -> PipeShape:
        """What the module's topology asks of the job's parallel dimensions (comm/parallel_dims.py):
        its stages and its model axis (more than 1 when the script split its own layers)."""
        return PipeShape(pp=self.mesh_topology.pp, model_axis=self.mesh_topology.tp)

    @property
    def num_stages(self) -> int:
        """Pipeline stages of the job's layout."""
        return self.mesh_topology.pp

    @property
    def stage_id(self) -> int:
        """This rank's stage."""
        return self.mesh_topology.coord(self.global_rank)["pp"]

    @property
    def _num_layers(self) -> int:
        return len(self._layer_specs)

    def adopt_topology(self, topology: Topology) -> None:
        """Take the job's (pp, dp, tp) layout decided by comm/parallel_dims.py (Note: [3D layout] in
        docs/tensor-parallel.md): with AutoTP the stages stay where they are (a stage is a contiguous
        block of ranks either way) and the data-parallel size becomes what is left, so `topology()`
        and `_grid` answer DeepSpeed's 3D queries.

        Raises:
            ConfigError: `topology` has other stages or another world size than the module.
        """
        if topology == self.mesh_topology:
            return
        if topology.pp != self.mesh_topology.pp or topology.world_size != self.world_size:
            raise ConfigError(f"the job's layout {topology} does not keep the PipelineModule's "
                              f"{self.mesh_topology.pp} stages over {self.world_size} ranks")
        self.mesh_topology = topology
        self._topo = PipeModelDataParallelTopology(num_pp=topology.pp, num_mp=topology.tp, num_dp=topology.dp)

    def adopt_replaced_layers(self) -> None:
        """Run the modules now registered under each local layer's index: tensor parallelism
        replaces a layer that is itself an `nn.Linear` in place (`setattr(self, "3", ...)`)."""
        for chunk in self.local_chunks:
            start = self.parts[chunk]
            funcs = self._funcs[chunk]
            for offset, f in enumerate(funcs):
                current = self._modules.get(str(start + offset))
                if isinstance(f, nn.Module) and current is not None and current is not f:
                    funcs[offset] = current
        self._chunk_modules = [_Chunk(self, k, self._chunk_layer_modules(c)) for k, c in enumerate(self.local_chunks)]

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def tied_stage_ranks(self) -> dict[str, list[int]]:
        """Tie key -> the pipeline ranks (pp coordinates) holding it, for keys on more than one."""
        owners: dict[str, set[int]] = {}
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                owners.setdefault(layer.key, set()).add(self.stage_owner(idx) % self.num_stages)
        return {k: sorted(v) for k, v in sorted(owners.items()) if len(v) > 1}

    def tied_duplicates(self) -> frozenset[int]:
        """ids of this rank's tied weights whose key a lower stage also holds: after the tied
        gradients are summed over their stages, only the first holder counts them in the gradient
        norm (Note: [norm groups] in zero/strategy.py)."""
        return frozenset(id(p) for key, stages in self.tied_stage_ranks().items()
                         if self.stage_id in stages[1:] for p in self.tied_parameters(key))

    def tied_parameters(self, key: str) -> list[nn.Parameter]:
        """The tied weights of `key` on this rank (the attributes its TiedLayerSpec names)."""
        out = []
        for attr in self.tied_weight_attrs[key]:
            obj: Any = self.tied_modules[key]
            for part in attr.split("."):
                obj = getattr(obj, part)
            out.append(obj)
        return out

    @property
    def num_layers(self) -> int:
        return self._num_layers

    def tie_map(self) -> dict[str, list[int]]:
        """Tie key -> the global layer indices built from it (every key, held here or not)."""
        out: dict[str, list[int]] = {}
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                out.setdefault(layer.key, []).append(idx)
        return out

    def partition_for(self, num_stages: int) -> list[int]:
        """The layer boundaries this module's partition method gives at `num_stages` stages
        (DeepSpeed's, for reading its checkpoints saved at another stage count)."""
        return self._partition(self.partition_method, num_stages)

    def to_sequential(self) -> SequentialLayers:
        """Every layer of the model (not only this stage's) in one module without a pipeline, named
        as a `torch.nn.Sequential` of the layers: layer i's parameters are `"i.<name>"`, a tied
        module's at the first layer of its key. Built with this module's seeding, so with
        `seed_layers=True` the values equal the pipeline's. A pipeline checkpoint loads into an
        engine on it and back (Note: [plain names of a pipeline] in checkpoint/pipe_files.py)."""
        return SequentialLayers(self._layer_specs, seed_fn=(self.seed_fn or _set_random_seed)
                                if self.seed_layers else None, base_seed=self.base_seed)

    def local_layers(self) -> list[tuple[int, nn.Module]]:
        """(global layer index, module) for each layer this rank holds that has a state (DeepSpeed
        writes one `layer_XX-model_states.pt` per such layer; a tied module is in each of its layers)."""
        out = []
        for chunk in self.local_chunks:
            for offset, f in enumerate(self._funcs[chunk]):
                if isinstance(f, nn.Module):  # a tied layer with a forward_fn has no file, as in DeepSpeed
                    out.append((self.parts[chunk] + offset, f))
        return out

    def describe_partition(self) -> str:
        """Each stage's layers, as the engine logs them at start-up."""
        counts = self._count_layer_params()
        total = sum(counts) or 1
        lines = []
        for s in range(len(self.parts) - 1):
            lo, hi = self.parts[s], self.parts[s + 1]
            names = ", ".join(f"{i}:{_layer_name(self._layer_specs[i])}" for i in range(lo, hi))
            lines.append(f"stage {s} (rank pp={s % self.num_stages}): layers [{lo}, {hi}) "
                         f"{sum(counts[lo:hi])} params ({100 * sum(counts[lo:hi]) / total:.0f}%): {names}")
        return "\n".join(lines)


class SequentialLayers(nn.Module):
    """A PipelineModule's layers run in order in one module (`PipelineModule.to_sequential()`):
    children named by global layer index, a tied module registered at the first layer of its key
    (and at its later layers without a `forward_fn`, as aliases)."""

    def __init__(self, layers: Sequence[Any], seed_fn: Callable[[int], None] | None = None,
                 base_seed: int = 1234) -> None:
        super().__init__()
        self._funcs: list[Any] = []
        tied: dict[str, nn.Module] = {}
        for idx, layer in enumerate(layers):
            if seed_fn is not None:
                seed_fn(base_seed + idx)
            if isinstance(layer, TiedLayerSpec):
                first = layer.key not in tied
                module = tied.setdefault(layer.key, layer.build() if first else tied.get(layer.key))
                if first or layer.forward_fn is None:
                    self.add_module(str(idx), module)
                self._funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
            elif isinstance(layer, (LayerSpec, nn.Module)):
                module = layer.build() if isinstance(layer, LayerSpec) else layer
                self.add_module(str(idx), module)
                self._funcs.append(module)
            else:
                self._funcs.append(layer)

    def forward(self, x: Any) -> Any:
        for f in self._funcs:
            x = f(x)
        return x


class DualPipeVModule(nn.Module):
    """DeepSpeed's DualPipeV pipeline module: not provided by zeroshard.

    Raises:
        NotSupportedError: always.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotSupportedError(
            "DualPipeVModule is not supported by zeroshard: build a PipelineModule and choose a schedule "
            'with the config\'s "pipeline": {"schedule": ...} ("1f1b", "gpipe", "interleaved_1f1b", '
            '"interleaved_zero_bubble")')
