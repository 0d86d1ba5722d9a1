"""Routing telemetry of the MoE layers: tokens per expert, dropped routes, imbalance, aux loss.

Each gate (layer.py's `TopKGate`) owns a `RouteCounter` once an engine attaches one: every
training forward adds its counts into one fp64 tensor on the router's device, with no host sync
(Note: [routing telemetry]). `RoutingTelemetry` holds the counters of one model, hands their
sums over as one flat tensor (the engine reduces it over the data-parallel group, once, at a
logged step) and turns the totals into per-layer figures, monitor metrics and a progress line.
Imports torch and the moe package's own modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from zeroshard.moe.gating import Routes

# Note: [routing telemetry] The gate records each training forward's routes into device tensors
# (a few element-wise kernels per layer, no .item(), no collective), summed over the micro-batches
# of every optimizer step since the last logged step. Only at a logged step (steps_per_print) the
# engine packs every layer's sums into one tensor, all-reduces it over the data-parallel group
# and reads it back: one collective and one sync per report, whatever the number of layers. A
# forward inside backward (activation checkpointing's recompute) and an eval-mode forward are
# not counted, so a route counts once. Reported figures are per optimizer step, summed over
# ranks: the window's totals divided by the steps in the window (exact integers at
# steps_per_print 1).


def in_backward() -> bool:
    """True inside a backward pass: a forward there is a checkpointed region's recompute."""
    return torch._C._current_graph_task_id() != -1


class RouteCounter:
    """One gate's routing summed over the training forwards since the last `take()`.

    Layout of `take()`'s tensor (fp64): routes chosen per expert before capacity [experts], routes
    kept per expert [experts], the sum of `l_aux`, and the forwards counted (kept on the host
    until then: one kernel less per forward).

    Args:
        num_experts: experts of the layer over all expert-parallel ranks (the gate's columns).
    """

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self._sums: Tensor | None = None  # [2 * experts + 1] fp64, on the router's device
        self._forwards = 0

    @property
    def width(self) -> int:
        return 2 * self.num_experts + 2

    def record(self, routes: Routes) -> None:
        """Add one forward's routes (Note: [routing telemetry]: no host sync)."""
        e = self.num_experts
        if self._sums is None:
            self._sums = torch.zeros(self.width - 1, dtype=torch.float64, device=routes.exp_counts.device)
        kept = routes.experts >= 0  # [k, tokens]; -1 = dropped at capacity
        self._sums[:e] += routes.exp_counts
        self._sums[e:2 * e].index_add_(0, routes.experts.clamp(min=0).reshape(-1), kept.reshape(-1).double())
        self._sums[2 * e] += routes.l_aux.detach()
        self._forwards += 1

    def record_counts(self, counts: Tensor) -> None:
        """Add one forward's routes per expert from a dropless router (an AutoEP bank, moe/hf_experts.py:
        every route kept, no `l_aux` of the gate's own, so the forward is not counted for the aux mean)."""
        e = self.num_experts
        if self._sums is None:
            self._sums = torch.zeros(self.width - 1, dtype=torch.float64, device=counts.device)
        self._sums[:e] += counts
        self._sums[e:2 * e] += counts

    def take(self, device: torch.device) -> Tensor:
        """The sums so far (zeros when nothing was recorded), and start again from zero."""
        sums, forwards = self._sums, self._forwards
        self._sums, self._forwards = None, 0
        if sums is None:
            return torch.zeros(self.width, dtype=torch.float64, device=device)
        return torch.cat([sums.to(device), torch.tensor([float(forwards)], dtype=torch.float64, device=device)])


@dataclass(frozen=True, slots=True)
class LayerRouting:
    """One MoE layer's routing per optimizer step, summed over the data-parallel ranks."""

    name: str
    """The MoE module's name in the model (`blocks.0.moe`)."""
    tokens_per_expert: list[float]
    """Routes each expert was chosen for, before capacity (a token counts once per route, k per token)."""
    dropped: float
    """Routes dropped at capacity (0 without dropping: drop_tokens=False)."""
    imbalance: float
    """max / mean of `tokens_per_expert`: 1.0 is perfect balance, num_experts all on one."""
    aux_loss: float
    """The gate's `l_aux` (before the script's coefficient), mean over forwards and ranks."""

    @property
    def routes(self) -> float:
        return sum(self.tokens_per_expert)


def imbalance(tokens_per_expert: list[float]) -> float:
    """max / mean tokens per expert; nan when no token was routed."""
    total = sum(tokens_per_expert)
    if total <= 0:
        return float("nan")
    return max(tokens_per_expert) / (total / len(tokens_per_expert))


class RoutingTelemetry:
    """The route counters of one model's MoE layers, in module order (built by
    moe/prepare.py's `routing_telemetry` at initialize).

    Args:
        layers: (name, router) of every MoE layer; each router (a `TopKGate`, or an AutoEP bank that
            counts its own routes) gets a `RouteCounter`.
    """

    def __init__(self, layers: list[tuple[str, nn.Module]]) -> None:
        self.names = [name for name, _ in layers]
        self.counters = [RouteCounter(int(getattr(gate, "num_global_experts", 0) or gate.wg.out_features))
                         for _, gate in layers]
        for (_, gate), counter in zip(layers, self.counters):
            gate.route_counter = counter

    def take(self, device: torch.device) -> Tensor:
        """Every layer's sums since the last call, packed into one fp64 tensor (reset to zero)."""
        return torch.cat([c.take(device) for c in self.counters])

    def summarize(self, totals: list[float], steps: int) -> list[LayerRouting]:
        """Per-layer figures per optimizer step from `take()`'s tensor summed over ranks."""
        out, offset, steps = [], 0, max(steps, 1)
        for name, counter in zip(self.names, self.counters):
            e = counter.num_experts
            chunk = totals[offset:offset + counter.width]
            offset += counter.width
            tokens = [v / steps for v in chunk[:e]]
            dropped = (sum(chunk[:e]) - sum(chunk[e:2 * e])) / steps
            forwards = chunk[2 * e + 1]
            aux = chunk[2 * e] / forwards if forwards else float("nan")
            out.append(LayerRouting(name, tokens, dropped, imbalance(tokens), aux))
        return out


def routing_metrics(layers: list[LayerRouting]) -> dict[str, float]:
    """Monitor metrics (Note: [monitor events] in runtime/monitor.py): `moe{L}_...` per layer L."""
    metrics: dict[str, float] = {}
    for i, layer in enumerate(layers):
        for e, tokens in enumerate(layer.tokens_per_expert):
            metrics[f"moe{i}_tokens_expert{e}"] = tokens
        metrics[f"moe{i}_dropped"] = layer.dropped
        metrics[f"moe{i}_imbalance"] = layer.imbalance
        if not math.isnan(layer.aux_loss):  # an AutoEP bank's router has no aux loss of the gate's
            metrics[f"moe{i}_aux_loss"] = layer.aux_loss
    return metrics


def _count(v: float) -> str:
    return f"{v:.1f}".removesuffix(".0")


def routing_line(index: int, layer: LayerRouting) -> str:
    """One progress line for a layer: tokens per expert (min / max past 16 experts), dropped, imbalance, aux."""
    tokens = layer.tokens_per_expert
    if len(tokens) <= 16:
        shown = " ".join(map(_count, tokens))
    else:
        shown = f"min {_count(min(tokens))} max {_count(max(tokens))}"
    share = 100 * layer.dropped / layer.routes if layer.routes else 0.0
    imb = "n/a" if math.isnan(layer.imbalance) else f"{layer.imbalance:.2f}"
    aux = "" if math.isnan(layer.aux_loss) else f" | aux loss {layer.aux_loss:.4f}"
    return (f"moe{index} {layer.name} | tokens/expert {shown} | dropped {_count(layer.dropped)} of "
            f"{_count(layer.routes)} ({share:.1f}%) | imbalance {imb}{aux}")


__all__ = ["LayerRouting", "RouteCounter", "RoutingTelemetry", "imbalance", "routing_line", "routing_metrics"]
