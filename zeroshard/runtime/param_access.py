"""Read and write one parameter's fp32 master, gradient and optimizer state at any stage.

The engine behind DeepSpeed's `safe_get_full_fp32_param` & co. (exported by zeroshard.utils).
Each query asks the strategy for this rank's fragments (`checkpoint_fragments()`, the same
stage-blind description checkpoints use, Note: [checkpoint fragments]) and assembles the
parameter from them:

- full (`get_full`): one all-reduce of a zero-filled buffer to which each rank adds the
  fragments it owns. When every rank holds the whole parameter (stage 0) nothing is sent.
  Collective at stages 1-3: every rank must ask for the same parameters in the same order.
- local (`get_local`): this rank's fragments of the parameter, concatenated (1-D).

Which of the two a parameter is (owned once, or replicated on every rank) is learnt once per
engine by one all-reduce of per-parameter owned element counts, so no query branches on the
stage. `whole_weights` assembles a weights-only checkpoint load alike (stage-3 pieces summed
over the ranks). Reads the engine's public names only. Imports runtime/ and zero/ only (and
checkpoint_format for a type).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from zeroshard.zero.strategy import MasterFragment

if TYPE_CHECKING:
    from zeroshard.checkpoint_format import LoadedState
    from zeroshard.runtime.engine_api import EngineView

_ENGINE_OF: dict[int, tuple[weakref.ref[nn.Parameter], weakref.ref["EngineView"]]] = {}
"""id(model parameter) -> (the parameter, its engine), both weak (an engine may be dropped)."""


_OWNERSHIP: "weakref.WeakKeyDictionary[EngineView, _Ownership]" = weakref.WeakKeyDictionary()


def register_engine(engine: "EngineView", module: nn.Module) -> None:
    """Let the safe_* functions find `engine` from any parameter of `module`. Collective (one
    small all-reduce), so that later queries at stage 0 need no collective at all."""
    ref = weakref.ref(engine)
    for p in module.parameters():
        _ENGINE_OF[id(p)] = (weakref.ref(p), ref)
    _OWNERSHIP[engine] = _count_ownership(engine)


def forget_engine(engine: "EngineView") -> None:
    _OWNERSHIP.pop(engine, None)
    for key in [k for k, (_, e) in _ENGINE_OF.items() if e() is engine or e() is None]:
        del _ENGINE_OF[key]


def engine_of(param: nn.Parameter) -> "EngineView | None":
    """The live engine that trains `param`, or None (not given to zeroshard.initialize)."""
    entry = _ENGINE_OF.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


@dataclass
class _Ownership:
    replicated: dict[int, bool]
    """id(param) -> True when every rank holds all of it (nothing to send)."""


def _ownership(engine: "EngineView") -> _Ownership:
    if engine not in _OWNERSHIP:
        _OWNERSHIP[engine] = _count_ownership(engine)
    return _OWNERSHIP[engine]


def _count_ownership(engine: "EngineView") -> _Ownership:
    params = list(engine.module.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    owned = torch.zeros(len(params), dtype=torch.float64, device=engine.device)
    for f in engine.strategy.checkpoint_fragments():
        owned[index[id(f.param)]] += f.numel
    engine.comm.all_reduce(owned)
    world = engine.world_size
    replicated = {id(p): world > 1 and int(owned[i].item()) == world * p.numel() for i, p in enumerate(params)}
    return _Ownership(replicated)


def _fragments(engine: "EngineView", param: nn.Parameter) -> list[tuple[int, MasterFragment]]:
    """(position in checkpoint_fragments(), fragment) of `param` on this rank; a delayed
    optimizer step in flight finishes first, so masters and optimizer state read whole."""
    engine.strategy.wait_step()
    return [(i, f) for i, f in enumerate(engine.strategy.checkpoint_fragments()) if f.param is param]


Piece = tuple[int, Tensor]
"""(offset in the flattened parameter, 1-D values)."""


def _assemble(engine: "EngineView", param: nn.Parameter, pieces: list[Piece] | None, dtype: torch.dtype,
              ) -> Tensor | None:
    """The whole parameter from every rank's pieces; None when no rank had any (`pieces` None)."""
    numel = param.numel()
    if _ownership(engine).replicated.get(id(param), False) or engine.world_size == 1:
        if pieces is None:
            return None
        out = torch.empty(numel, dtype=dtype, device=engine.device)
        for off, value in pieces:
            out[off : off + value.numel()].copy_(value)
        return out.view(param.shape)
    buf = torch.zeros(numel + 1, dtype=torch.float32, device=engine.device)  # + "has data" flag
    for off, value in pieces or []:
        buf[off : off + value.numel()].copy_(value)
    buf[-1] = 1.0 if pieces is not None else 0.0
    engine.comm.all_reduce(buf)  # each element is owned by exactly one rank
    if buf[-1].item() == 0:
        return None
    return buf[:-1].to(dtype).view(param.shape)


def _engine_or_raise(param: nn.Parameter) -> "EngineView":
    engine = engine_of(param)
    if engine is None:
        raise ValueError(
            "this parameter is not trained by a zeroshard engine: pass the model to "
            "zeroshard.initialize() first (and use engine.module's parameters)")
    return engine


# -- masters ----------------------------------------------------------------------------------


def get_full_fp32_param(param: nn.Parameter) -> Tensor | None:
    """The whole fp32 master of `param` (a copy), or None for a parameter without one (frozen)."""
    engine = _engine_or_raise(param)
    frags = _fragments(engine, param)
    pieces = [(f.param_offset, f.master.detach().reshape(-1).float()) for _, f in frags]
    return _assemble(engine, param, pieces if frags else None, torch.float32)


def get_local_fp32_param(param: nn.Parameter) -> Tensor | None:
    """This rank's fragments of `param`'s fp32 master, concatenated (1-D; empty if none)."""
    engine = _engine_or_raise(param)
    if not param.requires_grad:
        return None
    frags = _fragments(engine, param)
    return torch.cat([f.master.detach().reshape(-1).float() for _, f in frags]) if frags else \
        torch.empty(0, dtype=torch.float32, device=engine.device)


def set_full_fp32_param(param: nn.Parameter, value: Tensor) -> None:
    """Write `value` into `param`'s fp32 master and the parameter itself. Collective at
    stages 1-3 (the new values are re-gathered into every rank's parameters)."""
    engine = _engine_or_raise(param)
    _check_shape(param, value)
    flat = value.detach().reshape(-1)
    with torch.no_grad():
        for _, f in _fragments(engine, param):
            f.master.data.view(-1).copy_(flat[f.param_offset : f.param_offset + f.numel])
    engine.strategy.sync_params_from_master()


# -- gradients --------------------------------------------------------------------------------


def _grads(engine: "EngineView") -> list[Tensor] | None:
    if not engine.grads_ready:
        return None
    return engine.strategy.fragment_grads(1.0 / engine.get_loss_scale())


def get_full_grad(param: nn.Parameter) -> Tensor | None:
    """The data-parallel averaged, unscaled gradient of `param` before clipping: valid after
    the `backward` that ends an accumulation step and before `step()`; None otherwise."""
    engine = _engine_or_raise(param)
    grads = _grads(engine)
    if grads is None:
        return None
    frags = _fragments(engine, param)
    pieces = [(f.param_offset, grads[i].reshape(-1)) for i, f in frags]
    return _assemble(engine, param, pieces if frags else None, torch.float32)


def get_local_grad(param: nn.Parameter) -> Tensor | None:
    """This rank's fragments of `param`'s reduced gradient (1-D; empty if none); None for a
    frozen parameter or outside the window `get_full_grad` describes."""
    engine = _engine_or_raise(param)
    grads = _grads(engine)
    if grads is None or not param.requires_grad:
        return None
    frags = _fragments(engine, param)
    return torch.cat([grads[i].reshape(-1) for i, _ in frags]) if frags else \
        torch.empty(0, dtype=torch.float32, device=engine.device)


def _grads_or_raise(engine: "EngineView", what: str) -> None:
    if not engine.grads_ready:
        raise ValueError(
            f"{what}: there is no reduced gradient to write now; call it after the backward that "
            "ends an accumulation step (is_gradient_accumulation_boundary()) and before step()")


def set_full_grad(param: nn.Parameter, value: Tensor) -> None:
    """Overwrite the averaged, unscaled gradient of `param` (the whole tensor, as
    `get_full_grad` returns it); `step()` then clips and applies it. Local: each rank writes
    the elements it owns, so every rank passes the same `value`."""
    engine = _engine_or_raise(param)
    _check_shape(param, value)
    _grads_or_raise(engine, "safe_set_full_grad")
    flat = value.detach().reshape(-1).to(device=engine.device, dtype=torch.float32)
    for i, f in _fragments(engine, param):
        engine.strategy.set_fragment_grad(i, flat[f.param_offset : f.param_offset + f.numel],
                                          1.0 / engine.get_loss_scale())


def set_local_grad(param: nn.Parameter, value: Tensor) -> None:
    """Overwrite this rank's fragments of `param`'s gradient (1-D, as `get_local_grad` returns)."""
    engine = _engine_or_raise(param)
    _grads_or_raise(engine, "safe_set_local_grad")
    frags = _fragments(engine, param)
    flat = _check_local(frags, value).to(device=engine.device, dtype=torch.float32)
    pos = 0
    for i, f in frags:
        engine.strategy.set_fragment_grad(i, flat[pos : pos + f.numel], 1.0 / engine.get_loss_scale())
        pos += f.numel


def update_full_grad_vectorized(param_list: list[nn.Parameter], update_func: Callable[[Tensor, nn.Parameter], Tensor],
                                ) -> None:
    """`set_full_grad(p, update_func(get_full_grad(p), p))` for each parameter that has a
    gradient. Collective at stages 1-3, like `get_full_grad`."""
    for p in param_list:
        if not p.requires_grad:
            continue
        grad = get_full_grad(p)
        if grad is None:
            _grads_or_raise(_engine_or_raise(p), "safe_update_full_grad_vectorized")
        set_full_grad(p, update_func(grad, p))


def _check_local(frags: list[tuple[int, MasterFragment]], value: Tensor) -> Tensor:
    want = sum(f.numel for _, f in frags)
    if value.numel() != want:
        raise ValueError(f"value has {value.numel()} elements; this rank's part of the parameter has "
                         f"{want} (the length safe_get_local_* returns on this rank)")
    return value.detach().reshape(-1)


def set_local_fp32_param(param: nn.Parameter, value: Tensor) -> None:
    """Overwrite this rank's fragments of `param`'s fp32 master (1-D, as
    `get_local_fp32_param` returns). Local: the model's parameter takes the new values at the
    next optimizer step (or `set_full_fp32_param`, which re-gathers at once), as in DeepSpeed."""
    engine = _engine_or_raise(param)
    frags = _fragments(engine, param)
    flat = _check_local(frags, value)
    pos = 0
    with torch.no_grad():
        for _, f in frags:
            f.master.data.view(-1).copy_(flat[pos : pos + f.numel])
            pos += f.numel


# -- optimizer state --------------------------------------------------------------------------


def _state_piece(engine: "EngineView", f: MasterFragment, key: str) -> Tensor | None:
    opt = engine.optimizer
    if opt is None or f.master not in opt.state or key not in opt.state[f.master]:
        return None
    value = opt.state[f.master][key]
    if not isinstance(value, Tensor) or value.numel() != f.numel:
        raise ValueError(f"optimizer state {key!r} is not per element ({type(value).__name__}); "
                         "only per-element states (exp_avg, exp_avg_sq, momentum_buffer) are assembled")
    return value.detach().reshape(-1)


def get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> Tensor | None:
    """The whole fp32 optimizer state `optim_state_key` of `param`; None before the first step."""
    engine = _engine_or_raise(param)
    frags = _fragments(engine, param)
    pieces = [(f.param_offset, _state_piece(engine, f, optim_state_key)) for _, f in frags]
    have = [(off, v) for off, v in pieces if v is not None]
    return _assemble(engine, param, have if have else None, torch.float32)


def get_local_optimizer_state(param: nn.Parameter, optim_state_key: str) -> Tensor | None:
    """This rank's fragments of `param`'s optimizer state (1-D; empty if none); None for a frozen
    parameter or before the first step."""
    engine = _engine_or_raise(param)
    if not param.requires_grad:
        return None
    values = [_state_piece(engine, f, optim_state_key) for _, f in _fragments(engine, param)]
    if any(v is None for v in values):
        return None
    return torch.cat(values) if values else torch.empty(0, dtype=torch.float32, device=engine.device)  # type: ignore[arg-type]


def set_full_optimizer_state(param: nn.Parameter, value: Tensor, optim_state_key: str) -> None:
    """Write `value` into `param`'s optimizer state `optim_state_key` (after the first step,
    when the state exists). Local: each rank writes the fragments it owns."""
    engine = _engine_or_raise(param)
    _check_shape(param, value)
    flat = value.detach().reshape(-1)
    for _, f in _fragments(engine, param):
        target = _state_piece(engine, f, optim_state_key)
        if target is None:
            raise ValueError(f"no optimizer state {optim_state_key!r} for this parameter yet: it is "
                             "created by the first optimizer step")
        target.copy_(flat[f.param_offset : f.param_offset + f.numel])


def set_local_optimizer_state(param: nn.Parameter, value: Tensor, optim_state_key: str) -> None:
    """Overwrite this rank's fragments of `param`'s optimizer state `optim_state_key` (1-D, as
    `get_local_optimizer_state` returns). Local."""
    engine = _engine_or_raise(param)
    frags = _fragments(engine, param)
    flat = _check_local(frags, value)
    pos = 0
    for _, f in frags:
        target = _state_piece(engine, f, optim_state_key)
        if target is None:
            raise ValueError(f"no optimizer state {optim_state_key!r} for this parameter yet: it is "
                             "created by the first optimizer step")
        target.copy_(flat[pos : pos + f.numel])
        pos += f.numel


def _check_shape(param: nn.Parameter, value: Tensor) -> None:
    if value.numel() != param.numel():
        raise ValueError(f"value has shape {tuple(value.shape)} ({value.numel()} elements); the "
                         f"parameter has shape {tuple(param.shape)} ({param.numel()} elements)")


SAFE_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "safe_get_full_fp32_param": get_full_fp32_param,
    "safe_set_full_fp32_param": set_full_fp32_param,
    "safe_get_full_grad": get_full_grad,
    "safe_get_full_optimizer_state": get_full_optimizer_state,
    "safe_set_full_optimizer_state": set_full_optimizer_state,
    "safe_get_local_fp32_param": get_local_fp32_param,
    "safe_get_local_grad": get_local_grad,
    "safe_get_local_optimizer_state": get_local_optimizer_state,
    "safe_set_full_grad": set_full_grad,
    "safe_set_local_grad": set_local_grad,
    "safe_set_local_fp32_param": set_local_fp32_param,
    "safe_set_local_optimizer_state": set_local_optimizer_state,
    "safe_update_full_grad_vectorized": update_full_grad_vectorized,
}
"""DeepSpeed's names (deepspeed.utils) -> the functions above."""


# -- checkpoints --------------------------------------------------------------------------------


def whole_weights(engine: "EngineView", loaded: "LoadedState") -> dict[str, Tensor]:
    """The whole state_dict of a weights-only load (`load_checkpoint(custom_load_fn=...)`):
    stage-3 pieces are gathered over the ranks. Collective."""
    src = dict(loaded.module)
    pieces = engine.strategy.param_pieces()
    if loaded.weight_pieces is None or pieces is None:
        return src
    flat: dict[int, Tensor] = {}  # param -> numel values + 1 flag "this rank read a piece"
    for piece, value in zip(pieces, loaded.weight_pieces, strict=True):
        full = flat.setdefault(id(piece.param), torch.zeros(piece.param.numel() + 1, dtype=torch.float32,
                                                            device=engine.device))
        if value is not None:
            full[piece.param_offset : piece.param_offset + piece.numel].copy_(value)
            full[-1] = 1.0
    for name, p in engine.module.named_parameters():
        full = flat.get(id(p), torch.zeros(p.numel() + 1, dtype=torch.float32, device=engine.device))
        engine.comm.all_reduce(full)  # each element is owned by one rank; the others add 0
        if full[-1].item() > 0:  # absent (a frozen parameter not saved): not in src
            src[name] = full[:-1].to(p.dtype).view(p.shape).cpu()
    return src
