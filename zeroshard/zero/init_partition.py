"""The machinery behind `zero.Init`: cut parameters to 1/N as modules are built.

A parameter built under `zero.Init` becomes a `ZeroParameter` whose state (`ZeroParamState`)
holds `init_shard` (this rank's 1/N of its flattened values, padded to a multiple of N), with a
one-element placeholder as data that keeps its true shape; `Stage3Strategy` later moves the
shards into its unit layout and takes the state over.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from zeroshard.zero.units import ZeroParameter, ZeroParamState, assign_data, make_zero_parameter, zero_state

if TYPE_CHECKING:
    from zeroshard.comm import Comm


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tensor of `shape` backed by one element: the data of a partitioned parameter."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def gather_init_shards(comm: "Comm", p: ZeroParameter, world_size: int) -> Tensor:
    """The whole flattened values of a `zero.Init` parameter (collective)."""
    shard = p._zs.init_shard
    if shard is None:
        raise AssertionError(f"expected a zero.Init shard for {p._zs.name!r}")
    full = torch.empty(shard.numel() * world_size, dtype=shard.dtype, device=p.device)
    comm.all_gather(full, shard.to(p.device))
    return full[: p.numel()]


class InitPartitioner:
    """Cuts parameters as their modules are attached; gathers them back for in-place init."""

    def __init__(self, comm: "Comm", rank: int, world_size: int, *, dtype: torch.dtype | None,
                 remote_device: str | None) -> None:
        self._comm, self._rank, self._world = comm, rank, world_size
        self._dtype = dtype
        self._home = torch.device(remote_device) if remote_device else None
        self._pending: dict[int, tuple[str, nn.Parameter]] = {}
        self._materialized: list[ZeroParameter] = []
        self._active = True

    # hooks ---------------------------------------------------------------------------------

    def on_param_registered(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not isinstance(param, ZeroParameter):
            self._pending[id(param)] = (f"{type(module).__name__}.{name}", param)

    def on_module_registered(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        # The child's __init__ has returned: its parameters are final, cut them now.
        if child is None:
            return
        self._repartition_materialized()
        for pname, p in child.named_parameters(prefix=name):
            if not isinstance(p, ZeroParameter):
                self._partition(p, f"{type(parent).__name__}.{pname}")

    def partition_module(self, module: nn.Module) -> None:
        """Cut every parameter of an already-built `module` (DeepSpeed's ``zero.Init(module=model)``):
        rank 0's values, as for a model built inside the block (collective; every rank passes the
        same model)."""
        for name, p in module.named_parameters():
            if not isinstance(p, ZeroParameter):
                self._partition(p, f"{type(module).__name__}.{name}")

    def finish(self) -> None:
        self._active = False  # from now on, reading a partitioned parameter is an error
        self._repartition_materialized()
        self.flush_pending()

    def flush_pending(self) -> None:
        """Cut the parameters of modules not attached to a parent (yet): a model's top level at
        the end of the block, or a sub-model at the end of a nested `zero.Init` block."""
        for name, p in list(self._pending.values()):
            if not isinstance(p, ZeroParameter):
                self._partition(p, name)
        self._pending.clear()

    # partitioning ----------------------------------------------------------------------------

    @torch.no_grad()
    def _partition(self, p: nn.Parameter, name: str) -> None:
        self._pending.pop(id(p), None)
        if self._dtype is not None and p.is_floating_point():
            p.data = p.detach().to(self._dtype)
        self._take_values_of(p, 0)  # every rank builds rank 0's model
        self._cut(make_zero_parameter(p, ZeroParamState(name=name, owner=self)))

    def _take_values_of(self, p: nn.Parameter, src: int) -> None:
        """Replace `p`'s whole values on every rank by rank `src`'s (collective)."""
        data = p.detach().contiguous()
        self._comm.broadcast(data, src=src)
        assign_data(p, data)

    def _cut(self, p: ZeroParameter) -> None:
        flat = p.detach().reshape(-1)
        chunk = -(-flat.numel() // self._world)
        padded = torch.zeros(chunk * self._world, dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()] = flat
        shard = padded[self._rank * chunk : (self._rank + 1) * chunk].clone()
        p._zs.init_shard = shard.to(self._home) if self._home is not None else shard
        assign_data(p, placeholder(p.shape, p.dtype, p.device))
        p._zs.gathered = False

    def on_demand(self, params: list[ZeroParameter]) -> bool:
        # Inside zero.Init: give the operation whole parameters; cut them again at the next
        # module boundary or when other parameters are asked for (peak: about one layer).
        if not self._active:
            return False
        keep = {id(p) for p in params}
        self._repartition_materialized(keep)
        for p in params:
            if p._zs.gathered:
                continue
            full = gather_init_shards(self._comm, p, self._world)
            assign_data(p, full.view(p.shape).clone())
            p._zs.gathered = True
            self._materialized.append(p)
        return True

    # -- zero.GatheredParameters before initialize() -----------------------------------------
    # Transformers gathers a model built under zero.Init (with modifier_rank=0) to initialise
    # its weights and to load from_pretrained, before initialize() hands the parameters to the
    # stage-3 strategy; the partitioner is their owner until then (UserGatherable, units.py).

    def gather_params(self, params: Sequence[ZeroParameter]) -> None:
        """Whole values of `params` on every rank until `release_params`; collective (every
        rank passes the same parameters in the same order)."""
        for p in _unique(params):
            if p._zs.gathered:
                continue
            full = gather_init_shards(self._comm, p, self._world)
            assign_data(p, full.view(p.shape).clone())
            p._zs.gathered = True

    @torch.no_grad()
    def release_params(self, params: Sequence[ZeroParameter], modifier_rank: int | None) -> None:
        """Cut `params` again; with `modifier_rank`, that rank's values (changed in the block)
        are broadcast first, so every rank keeps its 1/N of them."""
        for p in _unique(params):
            if not p._zs.gathered:
                continue
            if modifier_rank is not None:
                self._take_values_of(p, modifier_rank)
            self._materialized = [m for m in self._materialized if m is not p]
            self._cut(p)

    @property
    def world_size(self) -> int:
        return self._world

    def whole(self, p: ZeroParameter) -> Tensor:
        """`p`'s whole flattened values, gathered over the ranks this partitioner cut it over
        (collective over them): a strategy that takes the parameter over reads it through its
        owner, whatever group the strategy itself reduces over."""
        return gather_init_shards(self._comm, p, self._world)

    # -- loading a shard from a file (from_pretrained under the alias, compat/hf_loading.py) --

    def owned_range(self, p: ZeroParameter) -> tuple[int, int]:
        """[start, end) of `p`'s flattened values that this rank's shard holds (end may equal
        start: the last ranks of a small parameter hold only padding)."""
        shard = p._zs.init_shard
        if shard is None:
            raise AssertionError(f"expected a zero.Init shard for {p._zs.name!r}")
        chunk = shard.numel()
        start = min(self._rank * chunk, p.numel())
        return start, min(start + chunk, p.numel())

    @torch.no_grad()
    def load_shard(self, p: ZeroParameter, values: Tensor) -> None:
        """Set this rank's shard of `p` to `values` (its `owned_range` of the flattened values,
        any dtype): no collective, so ranks may each read their slice from storage."""
        shard = p._zs.init_shard
        start, end = self.owned_range(p)
        if shard is None or p._zs.gathered or values.numel() != end - start:
            raise AssertionError(f"{p._zs.name}: expected {end - start} values for a cut parameter, "
                                 f"got {values.numel()} (gathered={p._zs.gathered})")
        shard[: end - start].copy_(values.reshape(-1))
        shard[end - start :].zero_()

    @torch.no_grad()
    def _repartition_materialized(self, keep: set[int] | None = None) -> None:
        """Cut again the parameters `on_demand` gave whole, except `keep`. Rank 0's values are
        broadcast first, as at the first cut: a parent's `apply(init_weights)` that draws from
        each rank's own RNG (or reads the rank) still builds rank 0's model on every rank."""
        still = []
        for p in self._materialized:
            if keep is not None and id(p) in keep:
                still.append(p)
            else:
                self._take_values_of(p, 0)
                self._cut(p)
        self._materialized = still


def move_unpartitioned(module: nn.Module, device: torch.device, dtype: torch.dtype | None,
                       buffer_dtype: torch.dtype | None = None, fp32_buffers: Collection[int] = ()) -> None:
    """`module.to(device)` with floating-point parameters cast to `dtype` and floating-point
    buffers to `buffer_dtype` (None: each keeps its dtype, as DeepSpeed 0.19 keeps a rotary
    embedding's fp32 `inv_freq` under bf16) except those in `fp32_buffers` (ids), which become
    fp32 (`data_types.keep_in_fp32_modules`), that leaves `zero.Init` shards alone (casting the
    shards): moving a partitioned parameter with `.to` would materialise it whole."""
    for sub in module.modules():
        for _name, p in list(sub._parameters.items()):
            if p is None:
                continue
            state = zero_state(p)
            if state is not None and state.init_shard is not None:
                shard = state.init_shard
                if dtype is not None and shard.is_floating_point():
                    state.init_shard = shard.to(dtype)
                assign_data(p, placeholder(p.shape, dtype if dtype is not None and p.is_floating_point() else p.dtype,
                                           device))
            else:
                with torch.no_grad():
                    cast = dtype if dtype is not None and p.is_floating_point() else None
                    p.data = p.data.to(device=device, dtype=cast)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                cast = buffer_dtype if buffer_dtype is not None and b.is_floating_point() else None
                if id(b) in fp32_buffers:
                    cast = torch.float32
                sub._buffers[name] = b.to(device=device, dtype=cast)


def init_partitioned(p: Any) -> bool:
    """Whether `p` was cut by `zero.Init` and not yet taken over by a strategy."""
    state = zero_state(p)
    return state is not None and state.init_shard is not None


def init_values(p: ZeroParameter) -> Tensor:
    """The whole flattened values of a parameter `zero.Init` cut (collective over the ranks it was
    cut over: every one of them asks for the same parameters in the same order)."""
    owner = p._zs.owner
    if not isinstance(owner, InitPartitioner):
        raise AssertionError(f"{p._zs.name!r} is not held by zero.Init")
    return owner.whole(p)


@torch.no_grad()
def unpartition(module: nn.Module) -> int:
    """Give every `zero.Init` parameter of `module` its whole values back and make it a plain
    parameter again (collective; the count). AutoTP splits whole layers and makes every rank's
    copy equal first, so a model built under `zero.Init` is gathered before it is split: the
    peak is then the whole model, as without `zero.Init` (Note: [zero.Init under AutoTP] in
    tensor_parallel/setup.py)."""
    params = [p for p in _unique([q for q in module.parameters() if init_partitioned(q)])]
    for p in params:
        if not p._zs.gathered:
            assign_data(p, init_values(p).view(p.shape).clone())
        p.__class__ = nn.Parameter
        del p._zs
    return len(params)


@torch.no_grad()
def take_whole(p: nn.Parameter) -> Tensor | None:
    """For a parameter zero.Init cut: its whole values (shaped), and `p` made a plain parameter again
    (its data still the placeholder; the caller assigns it). None for any other parameter.
    Collective over the ranks it was cut over. AutoEP reads each expert bank so, one tensor at a time
    (Note: [expert banks under zero.Init] in moe/hf_experts.py)."""
    if not init_partitioned(p):
        return None
    zp: ZeroParameter = p  # type: ignore[assignment]  # init_partitioned: a ZeroParameter
    whole = zp.data if zp._zs.gathered else init_values(zp).view(zp.shape)
    zp.__class__ = nn.Parameter
    del zp._zs
    return whole


def _unique(params: Sequence[ZeroParameter]) -> list[ZeroParameter]:
    return list({id(p): p for p in params}.values())
