"""User-facing stage-3 helpers: `GatheredParameters`, `Init`, `register_external_parameter`.

    with zeroshard.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if rank == 0:
            model.lm_head.weight.zero_()      # re-partitioned to every rank on exit

Parameters that are not partitioned (stages 0-2) pass through unchanged, so the same code
runs at every stage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

from torch import nn

from zeroshard.errors import ConfigError
from zeroshard.zero.units import UserGatherable, ZeroParameter, zero_state


class GatheredParameters:
    """Gather stage-3 parameters whole on every rank for the duration of a `with` block.

    Args:
        params: a parameter or an iterable of parameters (e.g. `module.parameters()`).
        modifier_rank: the rank whose in-place changes are kept: on exit its values are
            broadcast and re-partitioned (master weights too). None: read-only, changes lost.
        enabled: False makes the block a no-op (for code shared across stages).

    Every rank must enter and leave the block together (the gather is collective).
    """

    def __init__(self, params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None,
                 fwd_module: Any = None, enabled: bool = True) -> None:
        plist = [params] if isinstance(params, nn.Parameter) else list(params)
        self._modifier_rank = modifier_rank
        self._by_owner: dict[int, tuple[UserGatherable, list[ZeroParameter]]] = {}
        if not enabled:
            return
        for p in plist:
            state = zero_state(p)
            if state is None or not isinstance(state.owner, UserGatherable):
                continue  # not partitioned (stages 0-2), or an owner without user gathers
            _, owned = self._by_owner.setdefault(id(state.owner), (state.owner, []))
            owned.append(p)  # type: ignore[arg-type]

    def __enter__(self) -> "GatheredParameters":
        for owner, params in self._by_owner.values():
            owner.gather_params(params)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for owner, params in self._by_owner.values():
            owner.release_params(params, None if exc_type is not None else self._modifier_rank)


class Init:
    """Build a model already partitioned: no rank ever holds the whole model.

        with zeroshard.zero.Init(dtype=torch.bfloat16):
            model = MyModel(config)            # or transformers.AutoModelForCausalLM.from_config
        engine, *_ = zeroshard.initialize(model=model, config=ds_config)   # stage 3

    As each submodule finishes its `__init__` and is attached to its parent, its parameters
    are broadcast from rank 0 (so every rank builds the same model, whatever its RNG state)
    and cut to this rank's 1/N; the module keeps the parameter objects, with their true shapes.
    Code that later touches a partitioned parameter inside the block (e.g. a model's own
    `apply(init_weights)`) gets it whole for that operation, after which it is cut again, so
    the peak stays near 1/N of the model plus the largest layer. Needs the process group of
    the job (torchrun / SLURM / MPI env, or world size 1).

    Blocks may nest (a model whose `__init__` builds sub-models under their own `zero.Init`, as
    transformers' VisionEncoderDecoderModel and multimodal models do through `from_config`): inner
    blocks join the outermost one (their arguments are not used); leaving one cuts what it built,
    and the parameters stay gatherable on demand until the outermost block ends.

    Args:
        enabled: False builds the model normally (for code shared across stages).
        dtype: cast floating-point parameters to this dtype as they are created.
        remote_device: "cpu" keeps the shards in CPU memory (parameter offload).
        config_dict_or_path: the job's ds_config (a dict or a path). Its parallel sizes decide the
            ranks the parameters are cut over (`_partition_groups`): ZeRO's data-parallel ranks, which
            are fewer than the world with `tensor_parallel.autotp_size`; the stage is checked by
            `initialize`.
        module: an already-built model to cut now (DeepSpeed's ``zero.Init(module=model)``; no `with`
            block needed): every rank must pass the same model, whose values are taken from rank 0.
        mpu: a Megatron-style mpu; its data-parallel group is the one the parameters are cut over.
        data_parallel_group: DeepSpeed's explicit group to cut over (a torch process group).
    """

    def __init__(self, *, enabled: bool = True, dtype: Any = None, remote_device: str | None = None,
                 config_dict_or_path: Any = None, module: Any = None, mpu: Any = None,
                 data_parallel_group: Any = None, **_deepspeed_only: Any) -> None:
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(f"zero.Init(module=...): expected an nn.Module, got {type(module).__name__}")
        self._enabled, self._dtype = enabled, dtype
        self._remote_device = remote_device
        self._config, self._mpu, self._dp_group = config_dict_or_path, mpu, data_parallel_group
        self._hooks: list[Any] = []
        self._nested = False
        if module is not None and enabled:  # DeepSpeed's already-built model: cut now, no `with` needed
            partitioner = self._new_partitioner()
            partitioner.partition_module(module)
            partitioner.finish()

    def _new_partitioner(self) -> Any:
        from zeroshard.comm import Comm
        from zeroshard.zero.init_partition import InitPartitioner

        groups = _partition_groups(self._config, self._mpu, self._dp_group)
        return InitPartitioner(Comm(groups), groups.rank, groups.world_size, dtype=self._dtype,
                               remote_device=self._remote_device)

    def __enter__(self) -> "Init":
        if not self._enabled:
            return self
        self._nested = bool(_OPEN)  # inside another zero.Init: join the outermost one's partitioner
        if self._nested:
            self._partitioner = _OPEN[0]._partitioner
            _OPEN.append(self)
            return self
        self._partitioner = self._new_partitioner()
        reg = nn.modules.module
        self._hooks = [
            reg.register_module_parameter_registration_hook(self._partitioner.on_param_registered),
            reg.register_module_module_registration_hook(self._partitioner.on_module_registered),
        ]
        _OPEN.append(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._enabled:
            return
        _OPEN.remove(self)
        if self._nested:
            if exc_type is None:
                self._partitioner.flush_pending()
            return
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if exc_type is None:
            self._partitioner.finish()


_OPEN: list[Init] = []
"""The `zero.Init` blocks open now, outermost first (only the first partitions)."""


def _partition_groups(config: Any, mpu: Any, data_parallel_group: Any) -> Any:
    """The ranks `zero.Init` cuts parameters over: the data-parallel group `initialize` will give
    ZeRO stage 3 for the same arguments, decided from them by comm/parallel_dims.py's `resolve_dims`
    (never from groups some earlier engine left behind). Data parallelism only (the usual case): the
    world, and no group is built (a DeviceMesh's groups would count in the construction peak
    tests/launch/test_zero_init_memory.py bounds).

    Raises:
        ConfigError: the config's parallel sizes do not fit the world, or an mpu is given with a
            data_parallel_group that is not its own.
    """
    from zeroshard.comm import init_distributed
    from zeroshard.comm.groups import wrap_process_group
    from zeroshard.comm.parallel_dims import resolve_dims
    from zeroshard.comm.topology import build_mesh
    from zeroshard.config import read_config_file, tensor_parallel_size
    from zeroshard.config.load import sequence_parallel_size

    world = init_distributed()
    if mpu is not None or data_parallel_group is not None:
        if mpu is not None and data_parallel_group not in (None, mpu.get_data_parallel_group()):
            raise ConfigError("zero.Init: pass mpu= or data_parallel_group=, not both (the mpu's data-parallel group "
                              "is the one the parameters are cut over)")
        if data_parallel_group is not None:
            return wrap_process_group(world, data_parallel_group)
        return wrap_process_group(world, mpu.get_data_parallel_group(), int(mpu.get_data_parallel_rank()),
                                  int(mpu.get_data_parallel_world_size()))
    raw = {} if config is None else config if isinstance(config, Mapping) else read_config_file(config)
    dims = resolve_dims(world.world_size, config_tp=tensor_parallel_size(raw), sp=sequence_parallel_size(raw))
    topology = dims.topology
    return world if topology.dp == world.world_size else build_mesh(world, topology).axis("dp")


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's way to say `module`'s forward uses `parameter` of another module.

    zeroshard needs no registration: a stage-3 parameter used outside its unit during a
    training forward is gathered on demand (and kept gathered from then on), so this only
    checks its arguments, for scripts written for DeepSpeed.

    Raises:
        TypeError: `module` is not an nn.Module or `parameter` not an nn.Parameter.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_external_parameter: module must be an nn.Module, got {type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"register_external_parameter: parameter must be an nn.Parameter, got "
                        f"{type(parameter).__name__}")


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """The inverse of `register_external_parameter`: nothing to undo (see there)."""
    register_external_parameter(module, parameter)
