"""`engine.offload_states()` / `reload_states()` at 1/2/3 ranks, stages 0-3.

On this CPU-only machine every state is already on the host, so the engine's call moves nothing
(tests/unit/test_ds_engine_compat.py). The mechanism itself (Note: [offload by storage] in
runtime/offload_states.py) is the same for host storages when asked to move them too
(`_offload_with(move_host_storages=True)`), which is what these tests drive: the selected
storages give their memory up, the others keep it, and after `reload_states()` training goes
on bitwise as if nothing had happened."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch._C import DisableTorchFunctionSubclass

import zeroshard
from zeroshard.errors import UsageError
from zeroshard.runtime.offload_states import STATES


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(self.frozen(x)).float().pow(2).mean()


def build(stage: int, precision: str, offload: bool) -> Any:
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 200}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "zero_optimization": zero,
                           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    torch.manual_seed(0)
    model = Net()
    engine, *_ = zeroshard.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=cfg)
    return engine


def train(engine: Any, rank: int, steps: range) -> list[float]:
    dtype = next(p for p in engine.module.parameters()).dtype
    out = []
    for step in steps:
        x = torch.randn(2, 16, generator=torch.Generator().manual_seed(10 * step + rank)).to(dtype)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def storages(engine: Any) -> dict[str, list[torch.UntypedStorage]]:
    with DisableTorchFunctionSubclass():
        return {k: [t.untyped_storage() for t in ts] for k, ts in engine._state_tensors().items()}


def weights(engine: Any) -> dict[str, torch.Tensor]:
    from zeroshard.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


CASES = [(stage, precision, offload) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16")
         for offload in ((False, True) if stage else (False,))]


@pytest.mark.parametrize("stage, precision, offload", CASES)
@pytest.mark.parametrize("include", [None, ["optim_states", "hp_params"], ["lp_grads", "contiguous_grad_buffer"]])
def test_offload_frees_what_it_names_and_reload_resumes_bitwise(groups: Any, stage: int, precision: str,
                                                                offload: bool, include: list[str] | None) -> None:
    engine, twin = build(stage, precision, offload), build(stage, precision, offload)
    assert train(engine, groups.rank, range(2)) == train(twin, groups.rank, range(2))
    before = {k: [s.nbytes() for s in ss] for k, ss in storages(engine).items()}
    wanted = set(STATES) if include is None else set(include)
    freed = engine._offload_with(wanted, pin_memory=False, non_blocking=False, move_host_storages=True)
    now = storages(engine)
    kept_ptrs = {s.data_ptr() for k, ss in now.items() if k not in wanted for s in ss if s.nbytes()}
    emptied = 0
    for k, ss in now.items():
        for s, was in zip(ss, before[k]):
            if k in wanted and was and s.data_ptr() not in kept_ptrs:
                assert s.nbytes() == 0, (k, was)  # given up
                emptied += 1
            elif k not in wanted:
                assert s.nbytes() == was, k  # untouched
    assert emptied > 0 and freed > 0
    if "optim_states" in wanted:
        assert all(s.nbytes() == 0 for s in now["optim_states"])
    if include == ["optim_states", "hp_params"] and stage < 3:  # the parameters stay: generate with them
        with torch.no_grad():
            x = torch.ones(2, 16, dtype=next(engine.module.parameters()).dtype)
            assert torch.isfinite(engine.module(x))
    with pytest.raises(UsageError, match="call engine.reload_states"):
        engine(torch.ones(2, 16))
    with pytest.raises(UsageError, match="call engine.reload_states"):
        engine.step()
    engine.reload_states()
    after = {k: [s.nbytes() for s in ss] for k, ss in storages(engine).items()}
    assert after == before
    assert train(engine, groups.rank, range(2, 4)) == train(twin, groups.rank, range(2, 4))
    mine, theirs = weights(engine), weights(twin)
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)


def test_offload_between_backward_and_step_keeps_the_gradients(groups: Any) -> None:
    """DeepSpeed's lp_grads case: offloaded after backward, reloaded, then the step."""
    engine, twin = build(2, "bf16", False), build(2, "bf16", False)
    for e in (engine, twin):
        x = torch.randn(2, 16, generator=torch.Generator().manual_seed(groups.rank)).to(torch.bfloat16)
        e.backward(e(x))
    engine._offload_with({"lp_grads"}, pin_memory=False, non_blocking=False, move_host_storages=True)
    engine.reload_states()
    engine.step()
    twin.step()
    mine, theirs = weights(engine), weights(twin)
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)


@pytest.mark.parametrize("stage", [1, 3])
def test_the_optimizer_offloads_and_reloads_as_the_engine(groups: Any, stage: int) -> None:
    """OpenRLHF calls `engine.optimizer.offload_states(include, device, pin_memory, non_blocking)`
    and `reload_states()` (DeepSpeed's ZeRO optimizers have both): the engine's calls."""
    engine, twin = build(stage, "fp32", False), build(stage, "fp32", False)
    assert train(engine, groups.rank, range(2)) == train(twin, groups.rank, range(2))
    engine.optimizer.offload_states(include=None, device="cpu", pin_memory=False, non_blocking=False)
    assert engine._offloaded.active
    with pytest.raises(UsageError, match="call engine.reload_states"):
        engine.step()
    engine.optimizer.reload_states(non_blocking=False)
    assert not engine._offloaded.active
    assert train(engine, groups.rank, range(2, 4)) == train(twin, groups.rank, range(2, 4))
