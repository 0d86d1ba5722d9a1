"""Lamb (foreach) against a plain per-parameter reference of DeepSpeed FusedLamb's update."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from zeroshard.errors import ConfigError, NotSupportedError
from zeroshard.optim.lamb import Lamb


class ReferenceLamb:
    """FusedLamb's kernel, one parameter at a time, written for reading."""

    def __init__(self, params: list[torch.Tensor], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01) -> None:
        self.params = params
        self.hp: dict[str, Any] = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                       eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_coeff=max_coeff,
                       min_coeff=min_coeff)
        self.state: dict[int, dict[str, Any]] = {}
        self.coeffs: list[float] = []

    @torch.no_grad()
    def step(self) -> None:
        hp = self.hp
        beta1, beta2 = hp["betas"]
        self.coeffs = []
        for i, w in enumerate(self.params):
            if w.grad is None:
                continue
            g = w.grad
            st = self.state.setdefault(i, {"step": 0, "m": torch.zeros_like(w), "v": torch.zeros_like(w)})
            st["step"] += 1
            t = st["step"]
            st["m"] = beta1 * st["m"] + (1 - beta1) * g
            st["v"] = beta2 * st["v"] + (1 - beta2) * g * g
            if hp["eps_inside_sqrt"]:
                denom = torch.sqrt(st["v"] + hp["eps"])
            else:
                denom = torch.sqrt(st["v"]) + hp["eps"]
            update = st["m"] / denom + hp["weight_decay"] * w
            w_norm = torch.sqrt((w * w).sum()).item()
            u_norm = torch.sqrt((update * update).sum()).item()
            if w_norm == 0 or u_norm == 0:
                coeff = 1.0
            else:
                coeff = min(max(w_norm / u_norm, hp["min_coeff"]), hp["max_coeff"])
            self.coeffs.append(coeff)
            if hp["bias_correction"]:
                step_size = hp["lr"] * math.sqrt(1 - beta2**t) / (1 - beta1**t)
            else:
                step_size = hp["lr"]
            w -= step_size * coeff * update


def make_params(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 4, generator=gen, dtype=dtype),  # ordinary weight
        torch.zeros(5, dtype=dtype),  # zero weight: ratio 1 on its first step
        torch.randn(4, generator=gen, dtype=dtype) * 1e3,  # huge norm: ratio clamped to max_coeff
        torch.randn(6, generator=gen, dtype=dtype) * 1e-6,  # tiny norm: ratio clamped to min_coeff
        torch.randn(2, generator=gen, dtype=dtype),  # gets a zero gradient every 3rd step
        torch.randn(3, generator=gen, dtype=dtype),  # never has a gradient
    ]


def set_grads(params: list[torch.Tensor], step: int, gen: torch.Generator) -> None:
    for i, p in enumerate(params[:5]):
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        if i == 4 and step % 3 == 0:
            p.grad.zero_()


def run_both(hp: dict[str, Any], dtype: torch.dtype, steps: int = 10) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ref_params = make_params(dtype)
    ours_params = [torch.nn.Parameter(p.clone()) for p in ref_params]
    ref = ReferenceLamb(ref_params, **hp)
    ours = Lamb(ours_params, **hp)
    gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for step in range(steps):
        set_grads(ref_params, step, gen_a)
        set_grads(ours_params, step, gen_b)  # type: ignore[arg-type]
        ref.step()
        ours.step()
        assert ours.get_lamb_coeffs() == pytest.approx(ref.coeffs, rel=1e-6 if dtype == torch.float32 else 1e-12)
    return ref_params, [p.detach() for p in ours_params]


HYPERS: list[dict[str, Any]] = [
    dict(lr=1e-2),
    dict(lr=1e-2, weight_decay=0.1),
    dict(lr=5e-3, weight_decay=0.01, betas=(0.8, 0.99), eps=1e-6, eps_inside_sqrt=True),
    dict(lr=1e-2, bias_correction=False, max_coeff=2.0, min_coeff=0.1, weight_decay=0.05),
]


@pytest.mark.parametrize("hp", HYPERS, ids=lambda hp: ",".join(f"{k}={v}" for k, v in hp.items()))
def test_matches_reference_float64(hp: dict[str, Any]) -> None:
    ref, ours = run_both(hp, torch.float64)
    for i, (a, b) in enumerate(zip(ref, ours)):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14, msg=f"param {i}")


def test_matches_reference_float32() -> None:
    ref, ours = run_both(dict(lr=1e-2, weight_decay=0.1), torch.float32)
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_trust_ratio_edge_cases_are_exercised() -> None:
    params = [torch.nn.Parameter(p) for p in make_params(torch.float64)]
    opt = Lamb(params, lr=1e-2)
    set_grads(params, step=1, gen=torch.Generator().manual_seed(1))  # type: ignore[arg-type]
    opt.step()
    coeffs = opt.get_lamb_coeffs()
    assert len(coeffs) == 5  # the parameter without a gradient is skipped
    assert coeffs[1] == 1.0  # ||w|| == 0
    assert coeffs[2] == 10.0  # clamped to max_coeff
    assert coeffs[3] == pytest.approx(0.01)  # clamped to min_coeff
    assert 0.01 < coeffs[0] < 10.0
    assert len(opt.state) == 5 and torch.equal(params[5], make_params(torch.float64)[5])
    for p in params[:4]:
        p.grad = None
    opt.step()  # only parameters that have a gradient are stepped
    assert len(opt.get_lamb_coeffs()) == 1 and opt.state[params[4]]["step"] == 2 and opt.state[params[0]]["step"] == 1


def test_zero_update_gives_unit_ratio() -> None:
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = Lamb([w], lr=0.1)
    w.grad = torch.zeros_like(w)
    opt.step()
    assert opt.get_lamb_coeffs() == [1.0] and torch.equal(w.detach(), torch.ones(3, dtype=torch.float64))


def test_groups_with_different_hyperparameters() -> None:
    ref_params = make_params(torch.float64)[:3]
    ours_params = [torch.nn.Parameter(p.clone()) for p in ref_params]
    ref_a = ReferenceLamb(ref_params[:2], lr=1e-2, weight_decay=0.1)
    ref_b = ReferenceLamb(ref_params[2:], lr=3e-3, max_coeff=5.0)
    ours = Lamb([{"params": ours_params[:2], "weight_decay": 0.1}, {"params": ours_params[2:], "lr": 3e-3,
                                                                     "max_coeff": 5.0}], lr=1e-2)
    gen = torch.Generator().manual_seed(2)
    for _ in range(10):
        for a, b in zip(ref_params, ours_params):
            a.grad = torch.randn(a.shape, generator=gen, dtype=a.dtype)
            b.grad = a.grad.clone()
        ref_a.step()
        ref_b.step()
        ours.step()
    for a, b in zip(ref_params, ours_params):
        torch.testing.assert_close(b.detach(), a, rtol=1e-12, atol=1e-14)


def test_state_dict_round_trip_resumes_exactly() -> None:
    hp: dict[str, Any] = dict(lr=1e-2, weight_decay=0.05)
    straight = [torch.nn.Parameter(p) for p in make_params(torch.float64)]
    opt = Lamb(straight, **hp)
    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in straight] for _ in range(10)]
    checkpoint: dict[str, Any] = {}
    for step, gs in enumerate(grads):
        if step == 5:
            checkpoint = {"opt": copy.deepcopy(opt.state_dict()), "params": [p.detach().clone() for p in straight]}
        for p, g in zip(straight, gs):
            p.grad = g.clone()
        opt.step()

    resumed = [torch.nn.Parameter(p) for p in checkpoint["params"]]
    opt2 = Lamb(resumed, **hp)
    opt2.load_state_dict(checkpoint["opt"])
    assert opt2.state[resumed[0]]["step"] == 5
    for gs in grads[5:]:
        for p, g in zip(resumed, gs):
            p.grad = g.clone()
        opt2.step()
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


def test_defaults_are_fused_lamb_defaults() -> None:
    opt = Lamb([torch.nn.Parameter(torch.zeros(1))])
    d = opt.defaults
    assert (d["lr"], d["bias_correction"], d["betas"], d["eps"], d["weight_decay"], d["max_coeff"],
            d["min_coeff"], d["eps_inside_sqrt"]) == (1e-3, True, (0.9, 0.999), 1e-8, 0.0, 10.0, 0.01, False)


def test_rejections() -> None:
    p = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(NotSupportedError, match="amsgrad"):
        Lamb(p, amsgrad=True)
    with pytest.raises(NotSupportedError, match="gradient_clipping"):
        Lamb(p, max_grad_norm=1.0)
    with pytest.raises(ConfigError, match="optimizer.params.betas"):
        Lamb(p, betas=(0.9, 1.0))
    with pytest.raises(ConfigError, match="optimizer.params.min_coeff"):
        Lamb(p, min_coeff=20.0)
