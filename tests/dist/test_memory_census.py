"""Memory you can trust: what the process really holds after the first step, against the estimate.

On CPU the measure is a census of live tensor storages (zeroshard.runtime.monitor.allocated_bytes)
after the first optimizer step minus the census before the model was built; the estimate is
the estimator's model states in every home plus the gradient staging pool the reducer keeps
for reuse (zero/reduce.py) and the module's non-parameter buffers. They agree within 5% at
every stage and offload, so neither the strategies' self-report nor the estimator can drift
from the allocations without a test failing.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from engine_helpers import init_engine, make_config

from zeroshard.config import load_config
from zeroshard.estimate import Setup, estimate_rank, spec_from_module
from zeroshard.examples.gpt import GPT, GPTConfig
from zeroshard.runtime.monitor import allocated_bytes

CASES = [(0, "none", "none"), (1, "none", "none"), (1, "cpu", "none"), (2, "none", "none"), (2, "cpu", "none"),
         (3, "none", "none"), (3, "cpu", "none"), (3, "cpu", "cpu")]


def _config(stage: int, opt: str, param: str, precision: str) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 20_000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 300
    if opt != "none":
        zero["offload_optimizer"] = {"device": opt}
    if param != "none":
        zero["offload_param"] = {"device": param}
    extra: dict[str, Any] = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    if precision == "bf16-master":  # bf16 master shard, gradients and Adam moments (stages 1-3)
        extra = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
    return make_config(zero_optimization=zero, **extra)


# bf16 masters exist at stages 1-3 only (stage 0 refuses them, as DeepSpeed does)
RUNS = [(c, p) for p in ("fp32", "bf16", "bf16-master") for c in CASES if p != "bf16-master" or c[0] > 0]


@pytest.fixture(autouse=True)
def _census_sees_this_test_only(frozen_heap: None) -> None:
    """conftest's frozen_heap: the census walks this test's objects, not the whole session's."""


@pytest.mark.parametrize("case,precision", RUNS, ids=["-".join(map(str, c)) + f"-{p}" for c, p in RUNS])
def test_census_matches_estimate(groups, case: tuple[int, str, str], precision: str) -> None:
    gc.collect()
    baseline = allocated_bytes(torch.device("cpu"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=4, n_head=4, n_embd=96, vocab_size=301))
    spec = spec_from_module(model)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    cfg = _config(*case, precision)
    engine = init_engine(model, cfg)
    g = torch.Generator().manual_seed(groups.rank)
    x = torch.randint(0, 301, (2, 32), generator=g)
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    del x, loss
    measured = allocated_bytes(torch.device("cpu")) - baseline
    setup = Setup.from_config(load_config(cfg, dp_world_size=groups.world_size), devices_per_node=groups.world_size)
    est = estimate_rank(spec, setup, groups.rank)
    expected = est.device.total + est.host.total + est.staging_pool + buffers
    pool = engine.transient_bytes()
    print(f"\n[census] stage {case} {precision} rank {groups.rank}: measured {measured} estimate {expected} "
          f"ratio {measured / expected:.4f} (pool measured {pool}, estimated {est.staging_pool})")
    assert abs(measured - expected) <= 0.05 * expected, (
        f"rank {groups.rank}: live tensors {measured} B vs estimate {expected} B "
        f"({measured / expected:.3f}x); staging pool {pool} B (estimated {est.staging_pool} B)")
    del engine, model
    gc.collect()
