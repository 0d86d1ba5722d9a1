"""Stage 3 building blocks: honest partitioned parameters and the choice of units.

A partitioned parameter keeps its Python object, its true shape, dtype and device (DeepSpeed
empties it to shape [0], a top user complaint). Its data is a view into its unit's gathered
flat buffer, whose storage is resized to zero bytes when the unit is released (as FSDP2 does),
so every view, including the ones autograd saved during forward, sees the data again as soon as
the unit is re-gathered. Reading a released parameter raises an error that says how to gather
it, instead of computing with garbage.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch._C import DisableTorchFunctionSubclass

from zeroshard.errors import ZeroshardError

# Reading metadata never needs the data; everything else does.
_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.requires_grad.__set__,
    torch.Tensor.grad.__get__, torch.Tensor.grad.__set__, torch.Tensor.is_leaf.__get__, torch.Tensor.grad_fn.__get__,
    torch.Tensor.data.__set__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
    torch.Tensor.element_size, torch.Tensor.__hash__, torch.Tensor.register_post_accumulate_grad_hook,
    torch.Tensor.register_hook, torch.Tensor.requires_grad_, torch.Tensor.is_floating_point,
    torch.Tensor.layout.__get__, torch.Tensor.is_sparse.__get__, torch.Tensor.is_cuda.__get__,
    torch.Tensor.is_meta.__get__, torch.Tensor.nbytes.__get__, torch.Tensor.itemsize.__get__,
    torch.Tensor.__repr__,
}


class PartitionedParameterError(ZeroshardError, RuntimeError):
    """A stage-3 parameter's data was read while it is partitioned across ranks."""


class ZeroParamStatus(Enum):
    """DeepSpeed's `ds_status` values (libraries compare against these)."""

    AVAILABLE = 1
    """Gathered: the whole parameter is on this rank."""
    NOT_AVAILABLE = 2
    """Partitioned: only this rank's shard exists."""
    INFLIGHT = 3
    """Being gathered."""


class ParamOwner(Protocol):
    """Who holds a partitioned parameter's values: the stage-3 strategy, or `zero.Init`'s
    partitioner before `initialize`."""

    def on_demand(self, params: list["ZeroParameter"]) -> bool:
        """Gather `params` for an operation outside a gather where allowed; False: refuse."""
        ...


@runtime_checkable
class UserGatherable(Protocol):
    """An owner that serves `zero.GatheredParameters` (collective, every rank in the same order)."""

    def gather_params(self, params: Sequence["ZeroParameter"]) -> None: ...

    def release_params(self, params: Sequence["ZeroParameter"], modifier_rank: int | None) -> None: ...


@runtime_checkable
class ShardHolder(Protocol):
    """An owner that keeps the parameter in its own shard layout (the stage-3 strategy); the
    DeepSpeed `ds_*` properties read it."""

    def param_index(self, param: "ZeroParameter") -> int: ...

    def local_shard(self, param: "ZeroParameter") -> Tensor: ...

    def is_persistent(self, param: "ZeroParameter") -> bool: ...


@dataclass(slots=True, eq=False)
class ZeroParamState:
    """Everything zeroshard keeps about one partitioned parameter, in one typed object (as
    FSDP2 keeps it in `FSDPParam`); a `ZeroParameter` holds it as `_zs`."""

    name: str
    """Fully qualified name, for error messages."""
    owner: ParamOwner
    unit: int = -1
    """The owning strategy's unit index (-1 under `zero.Init`, before `initialize`)."""
    gathered: bool = True
    """Whether the parameter's data is on this rank now."""
    init_shard: Tensor | None = None
    """`zero.Init`: this rank's 1/N of the flattened values (padded to a multiple of N) until
    the strategy moves it into its unit layout."""


class ZeroParameter(nn.Parameter):
    """The class a partitioned parameter takes on (its object and identity are kept).

    Its zeroshard state is one typed object, `_zs` (`ZeroParamState`), set by the owner that
    partitioned it (`zero.Init` or the stage-3 strategy) through `make_zero_parameter`.
    """

    _zs: ZeroParamState

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        if func not in _METADATA:
            released = [a for a in _params_in(args, kwargs) if not a._zs.gathered]
            if released:
                released[0]._zs_require_data(func, released)
        with DisableTorchFunctionSubclass():  # results are plain tensors, not ZeroParameters
            return func(*args, **(kwargs or {}))

    def _zs_require_data(self, func: Any, params: list["ZeroParameter"] | None = None) -> None:
        """Gather on demand where the owner allows it (during a training forward, inside
        zero.Init), else raise: every released parameter of one operation at once."""
        if self._zs.owner.on_demand(params or [self]):
            return
        raise PartitionedParameterError(
            f"parameter {self._zs.name!r} (shape {tuple(self.shape)}, {self.dtype}) is partitioned "
            f"across ranks by ZeRO stage 3; its data is not on this rank outside a gather "
            f"(operation: {getattr(func, '__name__', func)}). Read it inside "
            f"`with zeroshard.zero.GatheredParameters([param]):` (add modifier_rank=0 to change "
            f"it), or use engine.module(...) / engine(...), which gathers as it goes."
        )

    # -- DeepSpeed's ds_* attributes, read-only views of the strategy's state -------------------
    # PEFT, TRL and transformers detect and count ZeRO-3 parameters through these; the
    # parameter keeps its true shape, so ds_shape == shape and ds_numel == numel().

    # Under zero.Init, before initialize() builds the strategy, the parameter holds its own
    # shard (`ZeroParamState.init_shard`); the properties read that instead.

    @property
    def ds_id(self) -> int:
        """A number unique to this parameter within its engine (tied parameters share it);
        under zero.Init, before initialize, unique within the process."""
        owner = self._zs.owner
        return int(owner.param_index(self)) if isinstance(owner, ShardHolder) else id(self)

    @property
    def ds_numel(self) -> int:
        return self.numel()

    @property
    def ds_shape(self) -> torch.Size:
        return self.shape

    @property
    def ds_status(self) -> ZeroParamStatus:
        return ZeroParamStatus.AVAILABLE if self._zs.gathered else ZeroParamStatus.NOT_AVAILABLE

    @property
    def ds_tensor(self) -> torch.Tensor:
        """This rank's shard of the parameter (1-D, the parameter's dtype; may be empty)."""
        state = self._zs
        if state.init_shard is not None:
            return state.init_shard.reshape(-1)
        if not isinstance(state.owner, ShardHolder):
            raise AssertionError(f"expected {state.name!r} to have an init shard or a strategy")
        return state.owner.local_shard(self)

    @property
    def ds_persist(self) -> bool:
        """True for small parameters that stay gathered (`stage3_param_persistence_threshold`)."""
        owner = self._zs.owner
        return isinstance(owner, ShardHolder) and owner.is_persistent(self)

    def __repr__(self) -> str:
        state = "gathered" if self._zs.gathered else "partitioned"
        return f"ZeroParameter({self._zs.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, {state})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        if not self._zs.gathered:
            self._zs_require_data("pickle")
        with DisableTorchFunctionSubclass():
            return nn.Parameter(self.detach().clone(), self.requires_grad).__reduce_ex__(protocol)


def make_zero_parameter(p: nn.Parameter, state: ZeroParamState) -> ZeroParameter:
    """Turn `p` into a `ZeroParameter` in place (its object, identity and hooks are kept)."""
    p.__class__ = ZeroParameter
    zp: ZeroParameter = p  # type: ignore[assignment]
    zp._zs = state
    return zp


def zero_state(p: object) -> ZeroParamState | None:
    """The zeroshard state of a partitioned parameter, None for any other tensor."""
    return p._zs if isinstance(p, ZeroParameter) else None


def _params_in(args: Sequence[Any], kwargs: Any) -> list[ZeroParameter]:
    values = list(args) + list((kwargs or {}).values())  # nn.init passes tensor= as a keyword
    found = [a for a in values if isinstance(a, ZeroParameter)]
    for a in values:
        if isinstance(a, (list, tuple)):
            found += [x for x in a if isinstance(x, ZeroParameter)]
    return list({id(p): p for p in found}.values())


def default_units(module: nn.Module) -> list[nn.Module]:
    """Each block of every ModuleList, plus the root (as FSDP2's common wrapping)."""
    units = [module]
    for child in module.modules():
        if isinstance(child, nn.ModuleList):
            units.extend(child)
    return units


def assign_params(module: nn.Module, units: Sequence[nn.Module]) -> dict[int, list[tuple[str, nn.Parameter]]]:
    """Unit index -> [(fqn, param)]. A parameter reachable from several units (tied weights)
    belongs to their common ancestor unit, which is gathered whenever any of them runs."""
    unit_prefix = {}
    for name, sub in module.named_modules():
        for i, u in enumerate(units):
            if sub is u and i not in unit_prefix.values():
                unit_prefix[name] = i
    if units and id(units[0]) != id(module):
        raise ValueError("the first unit must be the root module")
    paths: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        paths.setdefault(id(p), []).append(name)
        params[id(p)] = p

    def unit_of_path(path: str) -> str:
        parts = path.split(".")[:-1]
        for depth in range(len(parts), -1, -1):
            prefix = ".".join(parts[:depth])
            if prefix in unit_prefix:
                return prefix
        raise AssertionError(f"no unit contains {path}")

    out: dict[int, list[tuple[str, nn.Parameter]]] = {i: [] for i in range(len(units))}
    for pid, names in paths.items():
        prefixes = {unit_of_path(n) for n in names}
        while len(prefixes) > 1:  # walk up to the common ancestor unit
            common = _common_prefix(prefixes)
            prefixes = {unit_of_path(common + ".x") if common else ""}
        out[unit_prefix[prefixes.pop()]].append((names[0], params[pid]))
    return out


def _common_prefix(paths: Iterable[str]) -> str:
    split = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside a forward's output (tensors, tuples, lists, dicts, dataclasses)."""
    from torch.utils._pytree import tree_leaves

    leaves = tree_leaves(obj)
    if hasattr(obj, "__dataclass_fields__") or (hasattr(obj, "keys") and not isinstance(obj, dict)):
        try:  # HF ModelOutput and dataclasses: walk their values
            leaves = tree_leaves(list(obj.values()) if hasattr(obj, "values") else vars(obj))
        except TypeError:
            pass
    return [t for t in leaves if isinstance(t, torch.Tensor)]
