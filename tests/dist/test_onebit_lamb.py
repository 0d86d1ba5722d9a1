"""1-bit Lamb (`"type": "OneBitLamb"`, optim/onebit_lamb.py) on the tiny GPT at stage 0, 1/2/3 ranks.

- Warm-up: DeepSpeed's LAMB rule (no bias correction, trust-ratio running average), against a
  per-parameter reference written here from that rule.
- After `freeze_step`: the loss stays within a stated band of the same LAMB uncompressed, and
  still falls.
- The momentum all-reduce moves the 1-bit wire bytes of optim/onebit_allreduce.py, ~1/32 of fp32's.
- Checkpoints: a resumed run equals the uninterrupted one bit for bit (frozen ratios, factors,
  scaling coefficients and errors come back); a Lamb run loads the checkpoint.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import global_batches, init_engine, make_config, make_model, train_engine
from test_onebit import _wire_bytes

from zeroshard.errors import ConfigError
from zeroshard.optim.onebit_allreduce import wire_bytes
from zeroshard.optim.onebit_lamb import OneBitLamb

FREEZE = 4
STEPS = 20
LR = 1e-2
WD = 0.01


def lamb1_config(freeze_step: int = FREEZE, **extra: Any) -> dict[str, Any]:
    return make_config(optimizer={"type": "OneBitLamb", "params": {
        "lr": LR, "weight_decay": WD, "freeze_step": freeze_step, "coeff_beta": 0.5,
        "comm_backend_name": "nccl"}}, **extra)


class ReferenceLamb(torch.optim.Optimizer):
    """1-bit Lamb's warm-up rule, parameter by parameter, uncompressed at every step."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, dict(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD))
        self.coeffs: list[list[float]] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        coeffs = []
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["m"], state["v"], state["freeze"] = torch.zeros_like(p), torch.zeros_like(p), 0.0
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = state["m"] / (state["v"].sqrt() + group["eps"]) + group["weight_decay"] * p
                w, u = float(p.norm()), float(update.norm())
                c = min(max(w / u, 0.01), 10.0) if w and u else 1.0
                if c != 1.0:
                    state["freeze"] = 0.5 * state["freeze"] + 0.5 * c
                coeffs.append(state["freeze"])
                p.add_(update, alpha=-group["lr"] * c)
        self.coeffs.append(coeffs)


def _batches(world: int, steps: int = STEPS) -> list:
    return global_batches(1, 2 * world) * steps  # one batch repeated: the loss really falls


def test_warmup_is_lamb_then_compression_stays_close(groups) -> None:
    rank, world = groups.rank, groups.world_size
    model = make_model()
    ref = init_engine(copy.deepcopy(model), make_config(optimizer=None), optimizer=ReferenceLamb)
    ref_losses, ref_params = train_engine(ref, _batches(world), rank, world)
    engine = init_engine(copy.deepcopy(model), lamb1_config())
    opt = engine.optimizer.optimizer  # the torch optimizer engine.optimizer wraps
    assert isinstance(opt, OneBitLamb)
    losses, params = train_engine(engine, _batches(world, FREEZE), rank, world)
    # Warm-up: the same rule on the same all-reduced gradients. Not bitwise: the reference takes
    # each norm on its own, OneBitLamb with torch._foreach_norm (another summation order), so the
    # trust ratios differ in the last bits; 1e-5 relative over 4 steps leaves 100x room.
    for step in range(FREEZE):
        for a, b in zip(params[step], ref_params[step]):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), f"warm-up step {step}"
        assert losses[step] == pytest.approx(ref_losses[step], rel=1e-5)
    frozen = [opt.state[p]["lamb_coeff_freeze"] for p in opt._params()]
    assert frozen == pytest.approx(ref.optimizer.coeffs[FREEZE - 1], rel=1e-5)
    assert opt.compressing and all(0.01 * 0.5 <= c <= 10 for c in frozen)
    more, _ = train_engine(engine, _batches(world, STEPS - FREEZE), rank, world)
    losses += more
    # After the warm-up the trust ratio is the frozen one times a factor in [0.5, 4] that moves
    # at most 10% a step, and (at world > 1) the momentum is averaged in 1 bit. Band: each loss
    # within [0.6, 1.25] x the uncompressed LAMB's. Measured (fp32, lr 1e-2, freeze 4, 20 steps):
    # ratios 0.87-1.00 at 1 rank, 0.88-1.00 at 2 ranks, 0.95-1.00 at 3 ranks (below 1: the frozen
    # early variance gives larger steps). Leaving the momenta scaled after the average measured
    # 1.29 at step 7 and NaN after, at 2 ranks. (At lr 3e-2 this tiny freeze_step diverges even at
    # 1 rank: the frozen ratio outgrows the factor's 10%-a-step correction; DeepSpeed advises
    # freeze_step >= 1 / (1 - coeff_beta) and far more in practice.)
    for step in range(FREEZE, STEPS):
        assert 0.6 * ref_losses[step] <= losses[step] <= 1.25 * ref_losses[step], (
            f"step {step}: 1-bit Lamb {losses[step]:.4f} vs LAMB {ref_losses[step]:.4f}\n{losses}\n{ref_losses}")
    assert losses[0] - losses[-1] > 0.5 * (ref_losses[0] - ref_losses[-1]), "1-bit Lamb still trains"
    factors = [opt.state[p]["last_factor"] for p in opt._params()]
    assert all(0.5 <= f <= 4.0 for f in factors)
    assert len(opt.get_lamb_coeffs()) == len(factors)


def test_momentum_allreduce_bytes(groups) -> None:
    rank, world = groups.rank, groups.world_size
    model = make_model()
    engine = init_engine(model, lamb1_config(comms_logger={"enabled": True}))
    log = engine._comm.log
    per_step = []
    for batch in _batches(world, FREEZE + 2):
        log.reset()
        train_engine(engine, [batch], rank, world)
        per_step.append(_wire_bytes(log.records, world))
    n = sum(p.numel() for p in model.parameters())
    if world == 1:
        assert per_step[FREEZE - 1] == per_step[FREEZE + 1] == 0
        return
    plain = 2 * (world - 1) / world * 4 * n
    assert per_step[FREEZE - 1] == pytest.approx(plain, rel=0.01)  # fp32 gradients during the warm-up
    # 1 bit per element plus two scales per parameter, and the 8-byte gradient-norm all-reduce.
    theory = wire_bytes([p.numel() for p in model.parameters()], world) + 2 * (world - 1) / world * 8
    assert per_step[FREEZE + 1] == pytest.approx(theory, rel=1e-9)
    assert per_step[FREEZE - 1] / per_step[FREEZE + 1] >= 20


def test_checkpoint_resume_is_bitwise_and_loads_into_lamb(groups, shared_dir: Path) -> None:
    rank, world = groups.rank, groups.world_size
    batches = _batches(world, FREEZE + 6)
    model = make_model()
    straight = init_engine(copy.deepcopy(model), lamb1_config())
    _, want = train_engine(straight, batches, rank, world)
    first = init_engine(copy.deepcopy(model), lamb1_config())
    train_engine(first, batches[: FREEZE + 3], rank, world)
    first.save_checkpoint(str(shared_dir))
    saved = first.optimizer.state[first.optimizer.optimizer._params()[0]]
    resumed = init_engine(make_model(seed=5), lamb1_config())
    resumed.load_checkpoint(str(shared_dir))
    got_state = resumed.optimizer.state[resumed.optimizer.optimizer._params()[0]]
    for key in ("lamb_coeff_freeze", "last_factor", "scaling_coeff"):
        assert got_state[key] == saved[key], key
    assert torch.equal(got_state["exp_avg_sq_fresh"], saved["exp_avg_sq_fresh"])
    assert resumed.optimizer.compressing
    _, got = train_engine(resumed, batches[FREEZE + 3 :], rank, world)
    for step, (a_list, b_list) in enumerate(zip(got, want[FREEZE + 3 :])):
        assert all(torch.equal(a, b) for a, b in zip(a_list, b_list)), f"resumed step {step}"
    lamb = init_engine(make_model(seed=5), make_config(optimizer={"type": "Lamb", "params": {"lr": LR}}))
    lamb.load_checkpoint(str(shared_dir))
    state = lamb.optimizer.state[lamb.optimizer.param_groups[0]["params"][0]]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and int(state["step"]) == FREEZE + 3


@pytest.mark.parametrize("params, message", [
    ({"factor_min": 5.0}, r"optimizer\.params\.factor_min: got 5\.0, expected in \(0, factor_max=4\.0\]"),
    ({"amsgrad": True}, r"amsgrad: true is not supported by OneBitLamb"),
    ({"cuda_aware": True}, r"cuda_aware"),
], ids=["factor_min", "amsgrad", "cuda_aware"])
def test_bad_params_are_named(groups, params: dict[str, Any], message: str) -> None:
    cfg = lamb1_config()
    cfg["optimizer"]["params"].update(params)
    with pytest.raises(Exception, match=message):
        init_engine(make_model(), cfg)


def test_refused_above_stage0(groups) -> None:
    cfg = lamb1_config()
    cfg["zero_optimization"] = {"stage": 1}
    with pytest.raises(ConfigError, match=r"OneBitLamb applies to zero_optimization\.stage 0 only"):
        init_engine(make_model(), cfg)
