"""MoE routing telemetry in one process (moe/telemetry.py): the gate's recorded counts against a
per-token loop, dropped routes at a capacity that drops and none without dropping, the imbalance
formula, what is not counted (eval, checkpoint recompute), the metrics and the progress line, and
`zeroshard report`'s MoE panels."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zeroshard.cli.report import main as report_main
from zeroshard.cli.report import read_run
from zeroshard.moe.layer import MoE
from zeroshard.moe.prepare import routing_telemetry
from zeroshard.moe.telemetry import LayerRouting, imbalance, routing_line, routing_metrics
from zeroshard.runtime.monitor import CsvSink

CPU = torch.device("cpu")
HIDDEN, EXPERTS = 6, 4


def moe(**kwargs: Any) -> MoE:
    return MoE(HIDDEN, nn.Linear(HIDDEN, HIDDEN), num_experts=EXPERTS, **kwargs)


def loop_counts(logits: torch.Tensor, k: int, experts: torch.Tensor) -> tuple[list[int], int]:
    """Per token: its k best experts (no noise) are its routes; a route the gate left at -1 was
    dropped. Returns (routes per expert before capacity, dropped routes)."""
    routed, dropped = [0] * logits.shape[1], 0
    for t in range(logits.shape[0]):
        for e in torch.topk(F.softmax(logits[t], dim=0), k).indices.tolist():
            routed[e] += 1
        dropped += sum(1 for r in range(k) if int(experts[r, t]) < 0)
    return routed, dropped


@pytest.mark.parametrize("k,drop", [(1, True), (2, True), (3, True), (1, False), (2, False)])
def test_counts_equal_a_per_token_loop(k: int, drop: bool) -> None:
    torch.manual_seed(0)
    layer = moe(k=k, capacity_factor=0.5, min_capacity=0, use_rts=False, drop_tokens=drop,
                top2_2nd_expert_sampling=False)
    model = nn.Sequential(layer)
    telemetry = routing_telemetry(model)
    gate = layer.deepspeed_moe.gate
    routes, micro = [], [torch.randn(3, 8, HIDDEN) for _ in range(3)]  # 3 micro-batches of 24 tokens
    gate.register_forward_hook(lambda _m, _i, out: routes.append(out))
    for x in micro:
        layer(x)
    want_routed, want_dropped, aux = [0] * EXPERTS, 0, 0.0
    for x, r in zip(micro, routes):
        logits = F.linear(x.reshape(-1, HIDDEN), gate.wg.weight)
        routed, dropped = loop_counts(logits, k, r.experts)
        want_routed = [a + b for a, b in zip(want_routed, routed)]
        want_dropped += dropped
        aux += float(r.l_aux.detach()) / len(micro)
    [got] = telemetry.summarize(telemetry.take(CPU).tolist(), steps=1)
    assert got.name == "0" and got.tokens_per_expert == want_routed
    assert got.dropped == want_dropped and (want_dropped > 0) == drop  # capacity 0.5 drops; dropless never
    assert got.aux_loss == pytest.approx(aux, rel=1e-6)
    assert got.imbalance == pytest.approx(max(want_routed) / (sum(want_routed) / EXPERTS))
    assert telemetry.take(CPU).abs().sum() == 0  # taken: the next window starts from zero


def one_hot_tokens(loads: list[int]) -> torch.Tensor:
    """Tokens whose router logits are 10 * one-hot of their expert (loads[e] tokens to expert e)."""
    assign = torch.cat([torch.full((n,), e) for e, n in enumerate(loads)])
    return F.pad(F.one_hot(assign, EXPERTS).float(), (0, HIDDEN - EXPERTS))


@pytest.mark.parametrize("factor,dropped", [(1.0, 3), (0.5, 4 + 1), (2.0, 0)])
def test_dropped_is_what_the_capacity_drops(factor: float, dropped: int) -> None:
    # 12 tokens, loads 6/3/2/1: capacity ceil(12 / 4 * factor) = 3, 2 (min 2), 6.
    layer = moe(k=1, capacity_factor=factor, min_capacity=2, use_rts=True)
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(10 * torch.eye(EXPERTS, HIDDEN))
    telemetry = routing_telemetry(layer)
    layer(one_hot_tokens([6, 3, 2, 1]))
    layer(one_hot_tokens([6, 3, 2, 1]))
    [got] = telemetry.summarize(telemetry.take(CPU).tolist(), steps=2)  # a window of 2 steps: per step
    assert got.tokens_per_expert == [6.0, 3.0, 2.0, 1.0] and got.dropped == dropped
    assert got.imbalance == pytest.approx(2.0)


def test_imbalance_is_max_over_mean() -> None:
    assert imbalance([6, 3, 2, 1]) == 2.0
    assert imbalance([5, 5, 5, 5]) == 1.0
    assert imbalance([8, 0, 0, 0]) == 4.0  # everything on one expert: num_experts
    assert math.isnan(imbalance([0, 0]))


def test_eval_and_recompute_forwards_are_not_counted() -> None:
    layer = moe(k=1, min_capacity=0)
    telemetry = routing_telemetry(layer)
    x = torch.randn(10, HIDDEN, requires_grad=True)
    out, l_aux, _ = checkpoint(layer, x, use_reentrant=False)
    (out.sum() + l_aux).backward()  # recomputes the gate inside backward
    layer.eval()
    layer(x)
    [got] = telemetry.summarize(telemetry.take(CPU).tolist(), steps=1)
    assert sum(got.tokens_per_expert) == 10  # the one training forward's 10 routes


def test_a_model_without_moe_gets_no_telemetry() -> None:
    assert routing_telemetry(nn.Sequential(nn.Linear(2, 2))) is None


def test_metrics_and_progress_line() -> None:
    layers = [LayerRouting("blocks.0.moe", [6.0, 3.0, 2.0, 1.0], 3.0, 2.0, 1.25),
              LayerRouting("blocks.1.moe", [2.5, 2.5], 0.0, 1.0, 1.0)]
    metrics = routing_metrics(layers)
    assert metrics["moe0_tokens_expert3"] == 1.0 and metrics["moe0_dropped"] == 3.0
    assert metrics["moe0_imbalance"] == 2.0 and metrics["moe1_aux_loss"] == 1.0 and len(metrics) == 4 + 3 + 2 + 3
    assert routing_line(0, layers[0]) == ("moe0 blocks.0.moe | tokens/expert 6 3 2 1 | dropped 3 of 12 (25.0%) | "
                                          "imbalance 2.00 | aux loss 1.2500")
    assert "tokens/expert 2.5 2.5 | dropped 0 of 5 (0.0%)" in routing_line(1, layers[1])
    many = LayerRouting("m", [float(i) for i in range(32)], 0.0, 1.9, 1.0)
    assert "tokens/expert min 0 max 31 |" in routing_line(2, many)


def test_report_draws_the_moe_panels(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the [report] extra is not installed")
    sink = CsvSink(str(tmp_path), "job")
    for step in range(1, 5):
        layers = [LayerRouting("moe", [4.0 + step, 4.0, 4.0, 4.0 - step], 1.0, imbalance([4.0 + step, 4, 4, 4 - step]),
                               1.0 + step)]
        sink.write(step, {"loss": 1.0 / step, **routing_metrics(layers)})
    sink.close()
    run = read_run(tmp_path)
    assert run.moe_layers() == {0: 4}
    assert run.moe_dropped_percent(0, 4) == pytest.approx([100 / 16] * 4)
    png = tmp_path / "r.png"
    assert report_main([str(tmp_path), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
