"""The estimator against what the engine holds: `engine.model_state_bytes()` on every rank.

Run at world sizes 1, 2 and 3 (tests/run.py): 3 gives uneven partitions, chunks ending in
padding and parameters cut across ranks. Every stage/offload combination the installed zeroshard
supports is compared (the config loader is asked, so stage 3 and parameter offload join as soon
as they load), in fp32 and bf16, with fp32 and bf16 gradient accumulation. Two checks per case:
the estimate from the live module equals the engine byte for byte, category by category and
home by home; the estimate from the parameter count alone is within 5% of the engine's total.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_helpers import init_engine, make_config

from zeroshard.config import load_config
from zeroshard.estimate import Setup, estimate_rank, spec_from_counts, spec_from_module, zero_stage_supported
from zeroshard.estimate.states import Device, RankEstimate, StateBytes, ZeroStage
from zeroshard.examples.gpt import GPT, GPTConfig

COMBOS: list[tuple[ZeroStage, Device, Device]] = [
    (0, "none", "none"), (1, "none", "none"), (1, "cpu", "none"), (2, "none", "none"),
    (2, "cpu", "none"), (3, "none", "none"), (3, "cpu", "none"), (3, "none", "cpu"), (3, "cpu", "cpu")]
SUPPORTED = [c for c in COMBOS if zero_stage_supported(*c)]
"""Asked of the config loader at collection time; identical on every rank (skips never differ)."""


def _model() -> GPT:
    # Odd sizes: 72-wide embeddings, a 301-token vocabulary, tied head; buckets of 5000 elements
    # make several buckets, each padded per rank.
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=32, n_layer=3, n_head=4, n_embd=72, vocab_size=301))


def _config(stage: int, opt: str, param: str, precision: str, grad_dtype: str | None) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 5000}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 300  # layer norms and biases stay whole
    if opt != "none":
        zero["offload_optimizer"] = {"device": opt}
    if param != "none":
        zero["offload_param"] = {"device": param}
    extra: dict[str, Any] = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    if grad_dtype:
        extra["data_types"] = {"grad_accum_dtype": grad_dtype}
    return make_config(zero_optimization=zero, **extra)


def _engine_homes(engine: Any) -> tuple[StateBytes, StateBytes]:
    """(device, offloaded) in the estimator's terms, from the engine's list of homes."""
    homes = engine.model_state_bytes()
    device = [h for h in homes if "offload" not in h.device]
    offload = [h for h in homes if "offload" in h.device]
    if len(device) != 1 or len(offload) > 1:
        raise AssertionError(f"expected one device home and at most one offload home, got {homes}")

    def conv(h: Any) -> StateBytes:
        return StateBytes(h.params, h.grads, h.master_params, h.optimizer_states)

    return conv(device[0]), conv(offload[0]) if offload else StateBytes()


def test_stage3_is_compared_once_supported() -> None:
    # Guards the parametrization below: it covers exactly what the loader accepts, so stage 3
    # and parameter offload are compared as soon as they load (never a silent skip).
    assert (0, "none", "none") in SUPPORTED and (2, "cpu", "none") in SUPPORTED
    for combo in COMBOS:
        assert (combo in SUPPORTED) == zero_stage_supported(*combo)


@pytest.mark.parametrize("precision,grad_dtype", [("fp32", None), ("bf16", None), ("bf16", "bf16")],
                         ids=["fp32", "bf16-fp32-grads", "bf16-bf16-grads"])
@pytest.mark.parametrize("combo", SUPPORTED, ids=["-".join(map(str, c)) for c in SUPPORTED])
def test_estimate_matches_engine(groups, combo: tuple[ZeroStage, Device, Device], precision: str,
                                 grad_dtype: str | None) -> None:
    model = _model()
    spec = spec_from_module(model)  # before initialize: the model as the user builds it
    cfg = _config(*combo, precision, grad_dtype)
    engine = init_engine(model, cfg)
    x = torch.randint(0, 301, (2, 32))
    engine.backward(engine(x, x))
    engine.step()  # the optimizer allocates its states at the first step
    device, host = _engine_homes(engine)
    setup = Setup.from_config(load_config(cfg, dp_world_size=groups.world_size),
                              devices_per_node=groups.world_size)
    est: RankEstimate = estimate_rank(spec, setup, groups.rank)
    assert est.device == device, (combo, precision, groups.rank, est.device, device)
    assert est.host == host, (combo, precision, groups.rank, est.host, host)
    # From the count alone (DeepSpeed's "all cold"): padding is bounded, not reproduced.
    cold = estimate_rank(spec_from_counts(spec.total_params, spec.largest_layer_params), setup, groups.rank)
    got = device.total + host.total
    assert abs(cold.device.total + cold.host.total - got) <= 0.05 * got, (combo, cold, got)
