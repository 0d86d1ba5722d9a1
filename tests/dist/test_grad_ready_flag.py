"""DeepSpeed's `param.ds_grad_is_ready` (Note: [ds_grad_is_ready] in zero/stage12.py): a module that
runs its weight gradient's backward itself, tile by tile, inside one backward (axolotl's tiled MLP
patch) marks all but the last tile's accumulation not ready; ZeRO takes the summed gradient once.
The tiled model must train as the untiled one (fp32, the tile sums' round-off only) at ZeRO 0-3;
without the flag honoured each tile's partial gradient is taken as the whole (checked by the test
with the flag never cleared)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import init_engine, make_config
from torch import Tensor, nn

TILES, VOCAB, WIDTH, STEPS = 3, 32, 16, 3


class _TiledBackward(torch.autograd.Function):
    """Forward: `layer(x)` without a graph. Backward: the layer's forward and backward again, one
    row tile at a time, the parameters' gradients summing in `.grad` across the tiles."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, layer: nn.Module, mark: bool) -> Tensor:
        ctx.layer, ctx.mark = layer, mark
        ctx.save_for_backward(x)
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (x,) = ctx.saved_tensors
        params = [p for p in ctx.layer.parameters() if p.requires_grad]
        x_grads = []
        tiles = list(zip(x.chunk(TILES), grad.chunk(TILES)))
        for i, (x_tile, g_tile) in enumerate(tiles):
            if ctx.mark:
                for p in params:
                    p.ds_grad_is_ready = i == len(tiles) - 1
            x_tile = x_tile.detach().requires_grad_(True)
            with torch.enable_grad():
                out = ctx.layer(x_tile)
            torch.autograd.backward(out, g_tile)
            x_grads.append(x_tile.grad)
        return torch.cat(x_grads), None, None


class _Net(nn.Module):
    def __init__(self, tiled: bool, mark: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.tiled, self.mark = tiled, mark

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h = self.embed(x).reshape(-1, WIDTH)
        h = _TiledBackward.apply(h, self.mid, self.mark) if self.tiled else self.mid(h)
        return F.cross_entropy(self.head(torch.tanh(h)), y.reshape(-1))


def _batches(world: int) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (2 * world, 6), generator=g), torch.randint(0, VOCAB, (2 * world, 6), generator=g))
            for _ in range(STEPS)]


def _train(model: nn.Module, stage: int, rank: int, world: int) -> tuple[list[float], list[Tensor]]:
    from zeroshard.zero import GatheredParameters

    # Buckets smaller than one parameter: the tiled weight's bucket is complete at its first arrival.
    cfg = make_config(zero_optimization={"stage": stage, "reduce_bucket_size": 16,
                                         "stage3_param_persistence_threshold": 0})
    engine = init_engine(copy.deepcopy(model), cfg)
    losses = []
    for x, y in _batches(world):
        loss = engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return losses, [p.detach().clone() for p in params]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tiled_weight_gradient_trains_as_the_untiled_layer(groups: Any, stage: int) -> None:
    rank, world = groups.rank, groups.world_size
    want_losses, want = _train(_Net(tiled=False), stage, rank, world)
    got_losses, got = _train(_Net(tiled=True), stage, rank, world)
    for step, (a, b) in enumerate(zip(got_losses, want_losses)):
        assert abs(a - b) <= 1e-6 * abs(b), (step, a, b)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (i, (a - b).abs().max().item())


@pytest.mark.parametrize("stage", [1, 2])
def test_without_the_flag_a_partial_gradient_is_taken(groups: Any, stage: int) -> None:
    """The control at ZeRO 1-2: with more than one rank, the same tiles with the flag never cleared
    train differently (the first tile's bucket is reduced before the other tiles arrive), so the
    test above measures the flag. At one rank stage 1 reduces nothing and later tiles still sum in
    place (stage 2 differs there too). Stage 3 sums a unit's later arrivals into its reduction
    itself, so it needs no control."""
    rank, world = groups.rank, groups.world_size
    _, want = _train(_Net(tiled=False), stage, rank, world)
    _, got = _train(_Net(tiled=True, mark=False), stage, rank, world)
    differs = any(not torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(got, want))
    assert differs or (world == 1 and stage == 1)
