"""The engine's side of checkpoints: how it collects what it saves (`collect_state`) and how it
applies what was loaded (`apply_state`). The format types (`Manifest`, `EngineState`, ...) and the
`Checkpointer` protocol that moves both to and from disk live in zeroshard/checkpoint_format.py,
which the offline tools import without the runtime.

The engine does not import zeroshard.checkpoint (STYLE §1): `collect_state` returns tensors
plus a `Manifest`, and `initialize()` hands the engine a `Checkpointer` that writes them.
Nothing here touches files. Imports runtime/, zero/, optim/ (the 1-bit optimizers' state keys),
moe/ (the MoE layers' expert-parallel sizes, for the manifest) and checkpoint_format.py only.

Note: [checkpoint fragments] Trainable state is described per *fragment*: a range
`[param_offset, param_offset + numel)` of one flattened parameter, identified by the
parameter's index in `Manifest.params`. A fragment has an fp32 master and optimizer state.
Stage 0 has one whole-parameter fragment per parameter, stages 1-3 the pieces of their shard.
Loading at another world size or stage intersects the saved fragments with the new ones.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from zeroshard.checkpoint_format import (
    BANKS,
    EngineState,
    LoadedState,
    Manifest,
    Range,
    TensorInfo,
    pickle_bytes,
    unpickle_bytes,
)
from zeroshard.moe.hf_experts import expert_banks
from zeroshard.moe.prepare import moe_layers
from zeroshard.optim.onebit_adam import STATE_KEYS as ONEBIT_STATE_KEYS
from zeroshard.optim.onebit_adam import OneBitOptimizer, drop_onebit_state
from zeroshard.zero.offload.zenflow import ZenFlowStep
from zeroshard.zero.offload.zenflow_state import KEYS as ZENFLOW_STATE_KEYS
from zeroshard.zero.strategy import MasterFragment, ZeroStrategy

if TYPE_CHECKING:
    from zeroshard.runtime.engine_api import EngineView

logger = logging.getLogger("zeroshard")

# -- collecting ---------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _param_tables(module: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], dict[str, str]]:
    named = list(module.named_parameters())
    canonical = {id(p): n for n, p in named}
    aliases = {n: canonical[id(p)] for n, p in module.named_parameters(remove_duplicate=False)
               if canonical[id(p)] != n}
    return named, aliases


def _persistent_buffers(module: nn.Module) -> list[tuple[str, Tensor]]:
    out = []
    for mod_name, mod in module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                out.append((f"{mod_name}.{name}" if mod_name else name, buf))
    return out


def _fragment_state(optimizer: torch.optim.Optimizer | None, frag: MasterFragment) -> tuple[dict[str, Any], list[str]]:
    if optimizer is None or frag.master not in optimizer.state:
        return {}, []
    state, elementwise = {}, []
    for key, value in optimizer.state[frag.master].items():
        if isinstance(value, Tensor) and value.dim() > 0 and value.numel() == frag.numel:
            state[key] = value.detach().reshape(-1)
            elementwise.append(key)
        else:
            state[key] = value
    return state, sorted(elementwise)


def run_state_of(engine: "EngineView") -> dict[str, Any]:
    """Counters, scheduler, loss scaler, data loader: small, plain, saved by rank 0."""
    sched = engine.lr_scheduler
    loader = engine.training_dataloader
    scaler = engine.loss_scaler
    return {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        # Pickled to bytes: a client scheduler's state may hold arbitrary objects, and the
        # model file must stay loadable with torch.load(weights_only=True).
        "lr_scheduler": pickle_bytes(sched.state_dict()) if sched is not None else None,
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "data_loader": loader.state_dict() if hasattr(loader, "state_dict") else None,
    }


def _bank_params(module: nn.Module) -> dict[str, int] | None:
    """Each AutoEP bank parameter's name -> the bank's experts in all (Manifest.expert_banks)."""
    names = {id(p): n for n, p in module.named_parameters()}
    out = {names[id(p)]: b.num_global_experts for b in expert_banks(module) for p in b.parameters(recurse=False)
           if id(p) in names}
    return out or None


def collect_state(engine: "EngineView", strategy: ZeroStrategy, *, include_frozen: bool) -> EngineState:
    """This rank's state for a checkpoint: views of the live tensors plus the Manifest."""
    module, optimizer = engine.module, engine.optimizer
    zenflow = getattr(optimizer, "optimizer", None)
    if isinstance(zenflow, ZenFlowStep):
        zenflow.drain()  # the masters are read below (Note: [zenflow overlap])
    named, aliases = _param_tables(module)
    index = {id(p): i for i, (_, p) in enumerate(named)}
    params = [TensorInfo(n, tuple(p.shape), _dtype_name(p.dtype), p.requires_grad) for n, p in named]
    buffers = _persistent_buffers(module)
    frags = strategy.checkpoint_fragments()
    ranges, masters, states, elementwise = [], [], [], []
    for f in frags:
        if id(f.param) not in index:
            raise AssertionError("expected every fragment's parameter to be a parameter of the module")
        ranges.append((index[id(f.param)], f.param_offset, f.numel))
        masters.append((f.values if f.values is not None else f.master).detach().reshape(-1))
        state, keys = _fragment_state(optimizer, f)
        states.append(state)
        elementwise.append(keys)
    pieces = strategy.param_pieces()
    world, rank = engine.world_size, engine.rank
    whole: dict[str, Tensor] = {}
    piece_ranges: list[list[Range]] | None = None
    piece_data: list[Tensor] = []
    # Every rank lists the whole tensors (views, no copy): rank 0 writes them, and with
    # node-local storage so does each node's first rank (checkpoint/save.py).
    if pieces is None:
        whole = {n: p.detach() for n, p in named if p.requires_grad or include_frozen}
    else:
        piece_ranges = [[] for _ in range(world)]
        for pc in pieces:
            if pc.param.requires_grad or include_frozen:
                piece_ranges[rank].append((index[id(pc.param)], pc.param_offset, pc.numel))
                piece_data.append(pc.data.detach().reshape(-1))
    whole.update({n: b.detach() for n, b in buffers})
    manifest = Manifest(
        world_size=world, zero_stage=engine.zs_config.zero_optimization.stage, precision=engine.zs_config.precision,
        params=params, aliases=aliases,
        buffers=[TensorInfo(n, tuple(b.shape), _dtype_name(b.dtype)) for n, b in buffers],
        optimizer=type(optimizer).__name__ if optimizer is not None else None,
        param_groups=len(optimizer.param_groups) if optimizer is not None else 0,
        fragments=[ranges if r == rank else [] for r in range(world)], weight_pieces=piece_ranges,
        frozen_saved=include_frozen, global_steps=engine.global_steps,
        train_batch_size=engine.zs_config.train_batch_size,
        expert_parallel={**{m.expert_group_name: m.ep_size for m in moe_layers(engine.module)},
                         **{b.expert_group_name + BANKS: b.ep_size for b in expert_banks(engine.module)}} or None,
        expert_banks=_bank_params(module))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] if optimizer else []
    return EngineState(rank=rank, manifest=manifest, masters=masters, optimizer_states=states,
                       elementwise_keys=elementwise, param_groups=groups, module=whole,
                       weight_pieces=piece_data, run_state=run_state_of(engine), rng=rng_state())


# -- applying -----------------------------------------------------------------------------


_GROUP_KEYS_KEPT = ("params", "fused", "foreach", "capturable", "differentiable")
"""Group keys that belong to this run's optimizer object, not to the checkpoint."""


def _optimizer_state_dict(optimizer: torch.optim.Optimizer, frags: list[MasterFragment],
                          states: list[dict[str, Any]], groups: list[dict[str, Any]]) -> dict[str, Any]:
    by_master = {id(f.master): (f, s) for f, s in zip(frags, states)}
    state: dict[int, dict[str, Any]] = {}
    param_groups = []
    idx = 0
    for current, saved in zip(optimizer.param_groups, groups):
        ids = []
        for p in current["params"]:
            if id(p) in by_master:
                f, s = by_master[id(p)]
                if s:
                    state[idx] = {k: (v.view(p.shape) if isinstance(v, Tensor) and v.numel() == p.numel()
                                      and v.dim() > 0 else v) for k, v in s.items()}
            ids.append(idx)
            idx += 1
        merged = {**saved, **{k: current[k] for k in _GROUP_KEYS_KEPT if k in current}}
        merged["params"] = ids
        param_groups.append(merged)
    return {"state": state, "param_groups": param_groups}


@torch.no_grad()
def apply_state(engine: "EngineView", strategy: ZeroStrategy, loaded: LoadedState, *,
                load_lr_scheduler_states: bool, load_module_only: bool, load_rng_state: bool = False) -> None:
    """Copy what was loaded into the engine. Everything was read and checked before: this
    step does not fail halfway (Note: [no partial load] in checkpoint/load.py).

    The random generators and the data loader's position are restored only with
    `load_rng_state` (DeepSpeed's load leaves them to the script)."""
    zenflow = getattr(engine.optimizer, "optimizer", None)
    if (isinstance(zenflow, ZenFlowStep) and not load_module_only and loaded.optimizer_states is not None
            and loaded.param_groups is not None):
        zenflow.check_loadable(loaded.optimizer_states)
    if isinstance(zenflow, ZenFlowStep):
        zenflow.drain()  # the step in flight would overwrite the loaded masters (Note: [zenflow overlap])
    targets: dict[str, Tensor] = {**dict(_persistent_buffers(engine.module)),
                                  **dict(engine.module.named_parameters())}
    for name, value in loaded.module.items():
        target = targets[name]
        target.data.copy_(value.view(target.shape))
    if loaded.weight_pieces is not None:
        for piece, maybe in zip(strategy.param_pieces() or [], loaded.weight_pieces, strict=True):
            if maybe is not None:
                piece.data.copy_(maybe)
    frags = strategy.checkpoint_fragments()
    if loaded.masters is not None:
        # Masters first take the loaded weights: a separate master also covers frozen ranges
        # (stage 3), which no loaded master overwrites and the sync below copies back.
        strategy.sync_master_from_params()
        for frag, value in zip(frags, loaded.masters):
            frag.master.data.view(-1).copy_(value)
            if frag.values is not None:  # the fp32 master kept apart (NVMe home, low precision)
                frag.values.view(-1).copy_(value)
        strategy.sync_params_from_master()
    else:
        strategy.sync_master_from_params()
    if load_module_only:
        return
    opt = engine.optimizer
    if opt is not None and loaded.optimizer_states is not None and loaded.param_groups is not None:
        states = loaded.optimizer_states
        if not isinstance(opt.optimizer, OneBitOptimizer) and any(k in s for s in states for k in ONEBIT_STATE_KEYS):
            # A 1-bit optimizer's checkpoint resumed with plain Adam/Lamb: their state carries over,
            # the 1-bit state (errors, 1-bit Lamb's frozen ratios) is dropped.
            logger.info(f"load: the checkpoint's 1-bit Adam error buffers are dropped ({type(opt.optimizer).__name__} "
                        "keeps exp_avg, exp_avg_sq and step)")
            states = [drop_onebit_state(s) for s in states]
        if not isinstance(opt.optimizer, ZenFlowStep) and any(k in s for s in states for k in ZENFLOW_STATE_KEYS):
            logger.info("load: the checkpoint's ZenFlow state (accumulated gradient, selective AdamW) is dropped "
                        "(this run has no zero_optimization.zenflow)")
            states = [{k: v for k, v in s.items() if k not in ZENFLOW_STATE_KEYS} for s in states]
        opt.load_state_dict(_optimizer_state_dict(opt, frags, states, loaded.param_groups))
    if loaded.run_state is not None:
        _apply_run_state(engine, loaded.run_state, load_lr_scheduler_states, load_rng_state)
    if loaded.rng is not None and load_rng_state:
        set_rng_state(loaded.rng)


def _apply_run_state(engine: "EngineView", run: Mapping[str, Any], load_lr_scheduler_states: bool,
                     load_data_loader_state: bool) -> None:
    engine.global_steps = int(run["global_steps"])
    engine.global_samples = int(run["global_samples"])
    engine.micro_steps = int(run["micro_steps"])
    engine.skipped_steps = int(run["skipped_steps"])
    if load_lr_scheduler_states and engine.lr_scheduler is not None and run.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(unpickle_bytes(run["lr_scheduler"]))
    if engine.loss_scaler is not None and run.get("loss_scaler") is not None:
        engine.loss_scaler.load_state_dict(run["loss_scaler"])
    loader = engine.training_dataloader
    if (load_data_loader_state and loader is not None and hasattr(loader, "load_state_dict")
            and run.get("data_loader") is not None):
        loader.load_state_dict(run["data_loader"])


# -- helpers ------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and accelerator generator states, as weights_only-safe values."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (str(kind), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss),
                  float(gauss)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
