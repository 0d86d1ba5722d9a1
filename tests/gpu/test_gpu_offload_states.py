"""`engine.offload_states()` / `reload_states()` on a GPU: the accelerator memory goes down by
what was moved, training resumes bitwise, and `include=[optim_states, hp_params]` keeps the
parameters usable for generation. On the CPU the same mechanism is tested with host storages
(tests/dist/test_offload_states.py); only here does memory leave a device."""

from __future__ import annotations

import copy

import pytest
import torch
from gpu_helpers import global_batches, init_engine, make_model, precision_config, train_on_device


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("include", [None, ["optim_states", "hp_params"]])
def test_offload_frees_device_memory_and_resumes_bitwise(groups, stage: int, include: list[str] | None) -> None:
    base = make_model()
    config = precision_config(stage, "bf16", "none")
    engine, twin = init_engine(copy.deepcopy(base), config), init_engine(copy.deepcopy(base), config)
    batches = global_batches(4, 2 * 2 * groups.world_size)
    for e in (engine, twin):
        train_on_device(e, batches[:2], groups.rank, groups.world_size)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine.offload_states(include=include, pin_memory=True, non_blocking=True)
    torch.cuda.synchronize()
    during = torch.cuda.memory_allocated()
    assert during < before, (before, during)
    if include is not None and stage < 3:  # the bf16 parameters stayed: a forward still runs
        with torch.no_grad():
            x, y = batches[2]
            engine.module(x[:2].to(engine.device), y[:2].to(engine.device))
    engine.reload_states(non_blocking=True)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() >= before - 4096
    got, _ = train_on_device(engine, batches[2:], groups.rank, groups.world_size)
    want, _ = train_on_device(twin, batches[2:], groups.rank, groups.world_size)
    assert got == want
