"""Stage 3 building blocks: partitioned parameters and the choice of units.

A partitioned parameter keeps its Python object, its true shape, dtype and device (DeepSpeed
empties it to shape [0], a top user complaint). Its data is a view into its unit's gathered
flat buffer, whose storage is resized to zero bytes when the unit is released (as FSDP2 does),
so every view, including the ones autograd saved during forward, sees the data again as soon as
the unit is re-gathered. Outside a gather its values are not on this rank (Note: [partitioned
parameter access]).

Note: [partitioned parameter access] an operation on a released parameter that its owner cannot
serve by gathering (a training forward and `zero.Init` gather on demand) runs on DeepSpeed's
placeholder instead, an empty tensor (shape [0], the parameter's dtype and device): `p.data`,
`p.detach()`, `p.clone()`, `p.to(dtype)` and a `state_dict()` hand back empty tensors, as DeepSpeed
0.19.8 does, with one warning per process that names `GatheredParameters`; `p.to(...)` that changes
nothing returns `p` itself (torch's rule, which `module.to(...)` relies on). An operation that fails
on the placeholder (a matmul) raises `PartitionedParameterError` (a RuntimeError, as DeepSpeed's
shape error is) naming the parameter. Writes that would lose data are refused by name: an in-place
operation or `out=` on the parameter or on a placeholder taken from it, and `p.data = ...` (also
on a gathered parameter of the stage-3 strategy: it would leave the buffers that hold the values).
"""

from __future__ import annotations

import warnings
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
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel,
    torch.Tensor.element_size, torch.Tensor.__hash__, torch.Tensor.register_post_accumulate_grad_hook,
    torch.Tensor.register_hook, torch.Tensor.requires_grad_, torch.Tensor.is_floating_point,
    torch.Tensor.layout.__get__, torch.Tensor.is_sparse.__get__, torch.Tensor.is_cuda.__get__,
    torch.Tensor.is_meta.__get__, torch.Tensor.nbytes.__get__, torch.Tensor.itemsize.__get__,
    torch.Tensor.__repr__,
}


_SET_DATA = torch.Tensor.data.__set__
"""Compare with ==: each `torch.Tensor.data.__set__` is a new (equal) method-wrapper object."""

# In-place operators that are not named `*_` (Python's augmented assignments, item assignment).
_INPLACE_DUNDERS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__imatmul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__",
})


class PartitionedParameterError(ZeroshardError, RuntimeError):
    """A stage-3 parameter partitioned across ranks was written, or used in an operation that
    needs its values, outside a gather (Note: [partitioned parameter access])."""


class PartitionedParameterWarning(UserWarning):
    """A partitioned parameter was read outside a gather: the reader got an empty placeholder."""


_placeholder_warned = False
"""Whether this process has shown the `PartitionedParameterWarning` (it is shown once)."""


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
        kwargs = kwargs or {}
        if func == _SET_DATA and _set_data(args[0], args[1]):
            return None
        if func not in _METADATA:
            released = [a for a in _params_in(args, kwargs) if not a._zs.gathered]
            if released and not released[0]._zs.owner.on_demand(released):
                return _outside_gather(func, args, kwargs, released)
        with DisableTorchFunctionSubclass():  # results are plain tensors, not ZeroParameters
            return func(*args, **kwargs)

    def _zs_placeholder(self) -> Tensor:
        """DeepSpeed's partitioned `param.data`: empty, of this parameter's dtype and device."""
        with DisableTorchFunctionSubclass():
            empty = torch.empty(0, dtype=self.dtype, device=self.device)
            if self.requires_grad and (self.is_floating_point() or self.is_complex()):
                empty.requires_grad_(True)  # `p.clone()` has a grad_fn, as DeepSpeed's has
            return empty

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

    @property
    def ds_active_sub_modules(self) -> set[int]:
        """DeepSpeed's set of the submodules now using the parameter; always a fresh empty set here:
        zeroshard gathers and releases whole units and keeps no per-submodule count, so there is
        nothing to read and clearing it (TRL's `remove_hooks` does) changes nothing."""
        return set()

    def __repr__(self) -> str:
        state = "gathered" if self._zs.gathered else "partitioned"
        return f"ZeroParameter({self._zs.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, {state})"

    def partition_numel(self) -> int:
        """Elements of this parameter in this rank's shard (`ds_tensor.numel()`)."""
        return self.ds_tensor.numel()

    def ds_summary(self, use_debug_name: bool = False) -> dict[str, Any]:
        """DeepSpeed's one-line description of the parameter (its asserts and logs print it).

        The keys are DeepSpeed 0.19.8's; `active_sub_modules` is always empty (zeroshard gathers per
        unit, see `ds_active_sub_modules`); `numel` and `shape` are the true ones,
        as `p.numel()` and `p.shape` are here (DeepSpeed's are 0 and (0,) while partitioned).
        """
        grad = self.grad
        return {
            "id": f"name={self._zs.name} id={self.ds_id}" if use_debug_name else self.ds_id,
            "status": self.ds_status.name,
            "numel": self.numel(),
            "ds_numel": self.ds_numel,
            "shape": tuple(self.shape),
            "ds_shape": tuple(self.ds_shape),
            "requires_grad": self.requires_grad,
            "grad_shape": tuple(grad.shape) if grad is not None else None,
            "persist": self.ds_persist,
            "active_sub_modules": self.ds_active_sub_modules,
            "ds_tensor.shape": self.ds_tensor.shape,
        }

    def __reduce_ex__(self, protocol: Any) -> Any:
        data = self.detach()  # outside a gather: the placeholder, as DeepSpeed pickles [0]
        with DisableTorchFunctionSubclass():
            return nn.Parameter(data.as_subclass(Tensor).clone(), self.requires_grad).__reduce_ex__(protocol)


class PartitionedPlaceholder(Tensor):
    """The empty tensor a read of a partitioned parameter hands back (shape [0], the parameter's
    dtype and device, as DeepSpeed's). Tensors computed from it that are empty are placeholders
    too. Writing into one is refused by name: the values were never here, so the write would be
    lost (`p.data.normal_()` outside a gather). Pickles as a plain empty tensor."""

    _zs_name: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in _METADATA:
            hit = [t for t in _written(func, args, kwargs) if isinstance(t, PartitionedPlaceholder)]
            if hit:
                raise PartitionedParameterError(_write_message(hit[0]._zs_name, func, placeholder=True))
        names = [a._zs_name for a in _flat(args, kwargs) if isinstance(a, PartitionedPlaceholder)]
        try:
            with DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
        except RuntimeError as e:
            raise PartitionedParameterError(_failed_message(names[0] if names else "?", func, e)) from e
        return _as_placeholders(out, names[0]) if names else out

    def __reduce_ex__(self, protocol: Any) -> Any:
        with DisableTorchFunctionSubclass():
            return self.as_subclass(Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> "PartitionedPlaceholder":
        with DisableTorchFunctionSubclass():
            copied = self.as_subclass(Tensor).detach().clone().requires_grad_(self.requires_grad)
        memo[id(self)] = out = _as_placeholders(copied, self._zs_name)
        return out


def _outside_gather(func: Any, args: Sequence[Any], kwargs: dict[str, Any], released: list[ZeroParameter]) -> Any:
    """Run `func` with DeepSpeed's placeholders in place of the released parameters, or refuse it
    when it writes one (Note: [partitioned parameter access])."""
    written = {id(t) for t in _written(func, args, kwargs)}
    hit = [p for p in released if id(p) in written]
    if hit:
        raise PartitionedParameterError(_write_message(hit[0]._zs.name, func, placeholder=False))
    stand_in = {id(p): p._zs_placeholder() for p in released}
    _warn_placeholder(released[0])

    def swap(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(stand_in.get(id(x), x) for x in a)
        return stand_in.get(id(a), a)

    try:
        with DisableTorchFunctionSubclass():
            out = func(*[swap(a) for a in args], **{k: swap(v) for k, v in kwargs.items()})
    except RuntimeError as e:
        raise PartitionedParameterError(_failed_message(released[0]._zs.name, func, e)) from e
    by_stand_in = {id(v): p for p, v in zip(released, stand_in.values(), strict=True)}
    if isinstance(out, Tensor) and id(out) in by_stand_in:
        return by_stand_in[id(out)]  # `p.to(p.device)` is `p`, as torch returns self when nothing changes
    return _as_placeholders(out, released[0]._zs.name)


def _written(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The tensors `func` writes into: `self` of an in-place operation (`add_`, `+=`, `x[i] = v`,
    `torch._foreach_mul_`), `out=`, and the tensor whose `.data` is set."""
    name = getattr(func, "__name__", "")
    targets: list[Any] = []
    if func == _SET_DATA or (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS:
        if args:
            targets += list(args[0]) if isinstance(args[0], (list, tuple)) else [args[0]]
    out = kwargs.get("out")
    if out is not None:
        targets += list(out) if isinstance(out, (list, tuple)) else [out]
    return targets


def _write_message(name: str, func: Any, placeholder: bool) -> str:
    what = (f"a placeholder taken from parameter {name!r}" if placeholder else f"parameter {name!r}")
    return (
        f"{_op_name(func)} writes into {what}, which is partitioned across ranks by ZeRO stage 3: its "
        f"values are not on this rank outside a gather, so the write would be lost. Change it inside "
        f"`with zeroshard.zero.GatheredParameters([param], modifier_rank=0):` (rank 0's values are then "
        f"partitioned to every rank)."
    )


def _rebind_message(name: str) -> str:
    return (
        f"setting .data of parameter {name!r}: at ZeRO stage 3 the parameter is a view of the buffers that "
        f"hold its values (partitioned across ranks, or kept whole when it is small), so a new tensor would be "
        f"lost at the next gather or step. Assign (a tensor of the same shape and dtype) or change the values "
        f"in place inside `with zeroshard.zero.GatheredParameters([param], modifier_rank=0)`."
    )


def _failed_message(name: str, func: Any, error: RuntimeError) -> str:
    return (
        f"parameter {name!r} is partitioned across ranks by ZeRO stage 3; outside a gather it reads as an "
        f"empty placeholder of shape (0,), as in DeepSpeed, and {_op_name(func)} failed on it ({error}). Read "
        f"its values inside `with zeroshard.zero.GatheredParameters([param]):`, or use engine(...), which "
        f"gathers as it goes."
    )


def _op_name(func: Any) -> str:
    return "setting .data" if func == _SET_DATA else getattr(func, "__name__", str(func))


def _warn_placeholder(p: ZeroParameter) -> None:
    global _placeholder_warned
    if _placeholder_warned:
        return
    _placeholder_warned = True
    warnings.warn(
        f"parameter {p._zs.name!r} is partitioned across ranks by ZeRO stage 3: reading it outside a "
        f"gather (p.data, detach, clone, to, state_dict, ...) gives an empty placeholder of shape (0,), "
        f"as DeepSpeed does, not its values. Read the values inside "
        f"`with zeroshard.zero.GatheredParameters([param]):`. Shown once per process.",
        PartitionedParameterWarning, stacklevel=4)


def _as_placeholders(out: Any, name: str) -> Any:
    """Mark the empty tensors among `out` as placeholders of parameter `name`."""
    if type(out) in (list, tuple):  # not torch.Size, nor torch.return_types
        return type(out)(_as_placeholders(x, name) for x in out)
    if isinstance(out, Tensor) and not isinstance(out, (PartitionedPlaceholder, nn.Parameter)) and out.numel() == 0:
        with DisableTorchFunctionSubclass():
            marked = out.as_subclass(PartitionedPlaceholder)
        marked._zs_name = name
        return marked
    return out


def _flat(args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    values = list(args) + list(kwargs.values())
    return values + [x for a in values if isinstance(a, (list, tuple)) for x in a]


def _set_data(p: ZeroParameter, new: Tensor) -> bool:
    """`p.data = new` by a user; True when handled here, False for the plain rebind (an owner that is
    not stage 3's, e.g. zero.Init before `initialize`, which re-cuts its shard at the next gather).

    A no-op when `new` is `p` or its own data (`module.to(...)` when nothing changed; `p.data += x`,
    which Python ends with `p.data = <the same tensor>`). At stage 3 the data is a view of the
    strategy's buffers, so a gathered parameter takes `new`'s values in place (what a
    `GatheredParameters(modifier_rank=...)` block then hands to every rank, as DeepSpeed-Chat's LoRA
    fusion does); a released one, or another shape or dtype, is refused by name (it would be lost)."""
    with DisableTorchFunctionSubclass():
        if new is p or _same_view(p.data, new):
            return True
        if not isinstance(p._zs.owner, ShardHolder):
            return False
        if p._zs.gathered and new.shape == p.shape and new.dtype == p.dtype:
            p.data.copy_(new)
            return True
    raise PartitionedParameterError(_rebind_message(p._zs.name))


def _same_view(a: Tensor, b: Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def assign_data(p: nn.Parameter, data: Tensor) -> None:
    """`p.data = data` by the parameter's owner (the stage-3 strategy, `zero.Init`), which may
    rebind a partitioned parameter; users may not (Note: [partitioned parameter access])."""
    with DisableTorchFunctionSubclass():
        p.data = data


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
