"""Tiled compute (zeroshard/sequence/tiled.py: ALST's TiledMLP, sequence_tiled_compute,
TiledFusedLogitsLoss) against the same function untiled, in fp64: values, input gradients and
parameter gradients, tiles even and uneven. Where DeepSpeed is installed, also against DeepSpeed
0.19.8's own functions on the same inputs. And the point of zeroshard's version: each parameter's
gradient arrives once per backward (one post-accumulate hook call), where ZeRO expects it."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zeroshard.sequence.tiled import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

HIDDEN, VOCAB = 6, 11
TOL = 1e-12


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gate, self.up, self.down = nn.Linear(HIDDEN, 10), nn.Linear(HIDDEN, 10), nn.Linear(10, HIDDEN)
        self.double()

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def mlp_fn(module: MLP, x: Tensor) -> Tensor:
    return module(x)


def _grads(module: nn.Module, x: Tensor, run) -> tuple[Tensor, Tensor, list[Tensor]]:
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = run(x)
    g = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * g).sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in module.parameters()]


def _close(got: tuple, want: tuple) -> None:
    out, dx, dps = got
    wout, wdx, wdps = want
    assert (out - wout).abs().max() <= TOL
    assert (dx - wdx).abs().max() <= TOL
    assert all((a - b).abs().max() <= TOL for a, b in zip(dps, wdps))


@pytest.mark.parametrize("seq, shards", [(8, 1), (8, 2), (8, 4), (7, 3), (5, 5)])
def test_tiled_mlp_equals_the_mlp(seq: int, shards: int) -> None:
    mlp = MLP()
    x = torch.randn(2, seq, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = _grads(mlp, x, mlp)
    _close(_grads(mlp, x, lambda t: TiledMLP.apply(mlp_fn, mlp, t, shards, None)), want)
    _close(_grads(mlp, x, lambda t: TiledMLP.apply(mlp_fn, mlp, t, shards, list(mlp.parameters()))), want)


@pytest.mark.parametrize("seq, shards", [(8, 2), (7, 3)])
def test_sequence_tiled_compute_equals_the_function(seq: int, shards: int) -> None:
    mlp = MLP()
    x = torch.randn(2, seq, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    scale = torch.rand(2, seq, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def fn(hidden: Tensor, weight: Tensor, bias: float) -> Tensor:
        return mlp(hidden) * weight + bias

    want = _grads(mlp, x, lambda t: fn(t, scale, 0.5))
    _close(_grads(mlp, x, lambda t: sequence_tiled_compute(
        fn, seq, shards, {"hidden": t, "weight": scale}, {"bias": 0.5}, "hidden", list(mlp.parameters()),
        output_unshard_dimension=1, output_reduction=None)), want)
    positional = _grads(mlp, x, lambda t: SequenceTiledCompute.apply(
        fn, seq, shards, ["hidden", "weight"], ["bias"], "hidden", list(mlp.parameters()), 1, None, t, scale, 0.5))
    _close(positional, want)


def _loss_fn(head: nn.Linear, x: Tensor, y: Tensor, mask: Tensor | None = None) -> Tensor:
    losses = F.cross_entropy(head(x), y, reduction="none", ignore_index=-100)
    if mask is not None:
        losses = losses * mask
    return losses.sum()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("with_mask", [False, True])
def test_tiled_fused_logits_loss_equals_the_loss(reduction: str, with_mask: bool) -> None:
    torch.manual_seed(4)
    head = nn.Linear(HIDDEN, VOCAB).double()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 9, HIDDEN, dtype=torch.float64, generator=gen)
    y = torch.randint(0, VOCAB, (2, 9), generator=gen)
    y[0, :3] = -100
    mask = (torch.rand(2, 9, generator=gen) > 0.3).double() if with_mask else None
    shards = 3

    def untiled(t: Tensor) -> Tensor:  # the tiles' losses, then their mean or sum, as the tiled call defines it
        flat_x, flat_y = t.reshape(-1, HIDDEN), y.reshape(-1)
        flat_m = mask.reshape(-1) if mask is not None else None
        parts = [_loss_fn(head, a, b, *([m] if flat_m is not None else []))
                 for a, b, m in zip(flat_x.chunk(shards), flat_y.chunk(shards),
                                    flat_m.chunk(shards) if flat_m is not None else [None] * shards)]
        total = torch.stack(parts)
        return total.mean() if reduction == "mean" else total.sum()

    want = _grads(head, x, untiled)
    got = _grads(head, x, lambda t: 3.0 * TiledFusedLogitsLoss.apply(_loss_fn, head, t, y, mask, shards,
                                                                     [head.weight, head.bias], reduction) / 3.0)
    _close(got, want)


def test_each_parameter_gradient_arrives_once_per_backward() -> None:
    """ZeRO reduces a parameter when its gradient arrives: the tiles must not deliver it piecemeal."""
    mlp = MLP()
    calls: dict[str, int] = {}
    for name, p in mlp.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _t, n=name: calls.__setitem__(n, calls.get(n, 0) + 1))
    x = torch.randn(1, 8, HIDDEN, dtype=torch.float64, requires_grad=True)
    TiledMLP.apply(mlp_fn, mlp, x, 4, None).sum().backward()
    assert calls == {name: 1 for name, _ in mlp.named_parameters()}
    head = nn.Linear(HIDDEN, VOCAB).double()
    seen: list[int] = []
    head.weight.register_post_accumulate_grad_hook(lambda _t: seen.append(1))
    loss = TiledFusedLogitsLoss.apply(_loss_fn, head, x, torch.zeros(1, 8, dtype=torch.long), None, 4, None, "sum")
    assert seen == []  # computed in forward, delivered by the backward
    loss.backward()
    assert seen == [1]


def test_refusals_name_the_argument() -> None:
    mlp, x = MLP(), torch.randn(1, 4, HIDDEN, dtype=torch.float64)
    with pytest.raises(ValueError, match="shards: got 0"):
        TiledMLP.apply(mlp_fn, mlp, x, 0, None)
    with pytest.raises(ValueError, match='unknown reduction max: valid values are: "mean"/"sum"'):
        TiledFusedLogitsLoss.apply(_loss_fn, nn.Linear(HIDDEN, VOCAB), x, torch.zeros(1, 4), None, 2, None, "max")
    with pytest.raises(ValueError, match="batch/seq dims must match"):
        TiledFusedLogitsLoss.apply(_loss_fn, nn.Linear(HIDDEN, VOCAB), x, torch.zeros(1, 3), None, 2, None, "sum")
    with pytest.raises(ValueError, match="grad_requiring_tensor_key 'h' is not a key"):
        sequence_tiled_compute(mlp_fn, 4, 2, {"x": x}, {}, "h")


def _deepspeed_sp():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.sequence_parallel import ulysses_sp
    if "compat/alias" in ulysses_sp.__file__:
        pytest.skip("the deepspeed alias, not DeepSpeed")
    return ulysses_sp


def test_same_numbers_as_deepspeed_0_19_8() -> None:
    ds = _deepspeed_sp()
    mlp = MLP()
    x = torch.randn(2, 7, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    theirs = _grads(mlp, x, lambda t: ds.TiledMLP.apply(mlp_fn, mlp, t, 3, list(mlp.parameters())))
    _close(_grads(mlp, x, lambda t: TiledMLP.apply(mlp_fn, mlp, t, 3, None)), theirs)
    head = nn.Linear(HIDDEN, VOCAB).double()
    y = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(7))
    for scale in (1.0, 0.25):  # 0.25: the gradient reaching the loss (engine.backward's 1 / gas, fp16's scale)

        def loss_grads(tiled, scale=scale):
            head.zero_grad(set_to_none=True)
            t = x.detach().clone().requires_grad_()
            (tiled.apply(_loss_fn, head, t, y, None, 3, [head.weight, head.bias], "mean") * scale).backward()
            return t.grad, head.weight.grad.clone()

        (ours_dx, ours_dw), (their_dx, their_dw) = loss_grads(TiledFusedLogitsLoss), loss_grads(ds.TiledFusedLogitsLoss)
        assert (ours_dx - their_dx).abs().max() <= TOL
        # DeepSpeed 0.19.8 accumulates the head's gradient inside forward and never applies the gradient that
        # reaches the loss: equal at 1, `1 / scale` times too large otherwise (docs/deepspeed-differences.md)
        assert (ours_dw - their_dw * scale).abs().max() <= TOL
