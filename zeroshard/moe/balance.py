"""Auxiliary-loss-free load balancing (DeepSeek-V3): `expert_parallel.load_balance_coeff`.

Note: [expert bias balancing] Routers of the DeepSeek-V3 family (transformers 5: DeepseekV3,
DeepseekV32, Glm4Moe, Dots1, ExaoneMoe, ... `*TopkRouter`) add a per-expert bias,
`e_score_correction_bias`, to the routing scores when choosing each token's experts only: the
weights that scale the experts' outputs come from the unbiased scores, so the bias steers load
without a loss term and without a gradient. Hugging Face ships the buffer but nothing updates it.
Here every such router's forward is counted (its last output is the chosen expert ids [tokens,
k]); once per optimizer step (after the step, so every micro-batch of the accumulation counts,
and evaluation forwards and activation-checkpointing recomputes do not) the counts are summed
over the data-parallel ranks, one all-reduce for all layers, and each layer's bias moves by

    delta_e = coeff * sign(mean(load) - load_e),   bias_e += delta_e - mean(delta)

(DeepSeek-V3's update with speed `coeff`; the delta is centred as torchtitan centres it, so the
biases keep mean zero and cannot drift together). Every rank computes the same update from the
same sums, so the biases stay identical without a broadcast, and they are module buffers: the
checkpoints carry them. A step with no routed token leaves the biases as they are.
Imports torch, `zeroshard.comm` (types), `zeroshard.errors` and the moe package's telemetry.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from zeroshard.errors import ConfigError, NotSupportedError
from zeroshard.moe.telemetry import in_backward

if TYPE_CHECKING:
    from zeroshard.comm import Comm

logger = logging.getLogger("zeroshard")

BIAS = "e_score_correction_bias"


def bias_routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of `model` holding a selection bias (`e_score_correction_bias`), by name."""
    return [(name, m) for name, m in model.named_modules() if isinstance(getattr(m, BIAS, None), Tensor)]


class ExpertBiasBalance:
    """Counts every bias router's routes and updates its bias once per optimizer step.

    Args:
        routers: (name, module) of each router with an `e_score_correction_bias`.
        coeff: the bias update speed (`expert_parallel.load_balance_coeff`).
        comm: the data-parallel group (the ranks routing different tokens).
    """

    def __init__(self, routers: list[tuple[str, nn.Module]], coeff: float, comm: "Comm") -> None:
        self._names = [name for name, _ in routers]
        self._biases: list[Tensor] = [getattr(m, BIAS) for _, m in routers]
        self._coeff, self._comm = coeff, comm
        sizes = {b.numel() for b in self._biases}
        if len(sizes) != 1:
            raise NotSupportedError(f"expert_parallel.load_balance_coeff: the routers' expert counts differ "
                                    f"({sorted(sizes)}); one count for every MoE layer is built")
        self._experts = sizes.pop()
        self._counts: Tensor | None = None  # [layers, experts] fp64, summed since the last update
        self.updates = 0
        for i, (_, module) in enumerate(routers):
            module.register_forward_hook(self._counter(i))

    def _counter(self, layer: int) -> Any:
        def count(module: nn.Module, args: Any, output: Any) -> None:
            if not (module.training and torch.is_grad_enabled()) or in_backward():  # eval, recompute
                return
            ids = output[-1] if isinstance(output, tuple) else None
            if not (isinstance(ids, Tensor) and ids.dim() == 2 and not ids.is_floating_point()):
                raise NotSupportedError(
                    f"expert_parallel.load_balance_coeff: router {self._names[layer]} ({type(module).__name__}) "
                    "does not return the chosen expert ids [tokens, k] as its last output, so its load cannot "
                    "be counted; auxiliary-loss-free balancing is built for DeepSeek-V3-style TopkRouters")
            if self._counts is None:
                self._counts = torch.zeros(len(self._biases), self._experts, dtype=torch.float64, device=ids.device)
            self._counts[layer] += torch.bincount(ids.reshape(-1), minlength=self._experts).to(torch.float64)
        return count

    @torch.no_grad()
    def step(self) -> None:
        """After an optimizer step: sum the step's counts over the ranks and move every bias."""
        counts = self._counts
        if counts is None:
            counts = torch.zeros(len(self._biases), self._experts, dtype=torch.float64,
                                 device=self._biases[0].device)
        self._comm.all_reduce(counts)  # every rank calls it, even one that routed nothing
        self._counts = None
        for bias, load in zip(self._biases, counts):
            if load.sum() == 0:
                continue
            delta = self._coeff * torch.sign(load.mean() - load)
            bias.add_((delta - delta.mean()).to(device=bias.device, dtype=bias.dtype))
        self.updates += 1


def build_balance(model: nn.Module, coeff: float | None, comm: "Comm") -> ExpertBiasBalance | None:
    """`expert_parallel.load_balance_coeff`: the balancer over `model`'s bias routers; None when unset.

    Raises:
        ConfigError: a coefficient that is not positive, or a model without a bias router.
    """
    if coeff is None:
        return None
    if not coeff > 0:
        raise ConfigError(f"expert_parallel.load_balance_coeff must be > 0 (the bias update speed, DeepSeek-V3 "
                          f"uses 0.001), got {coeff!r}; remove the key to turn balancing off")
    routers = bias_routers(model)
    if not routers:
        raise ConfigError(
            f"expert_parallel.load_balance_coeff: the model ({type(model).__name__}) has no router with a selection "
            f"bias (`{BIAS}`: DeepSeek-V3, GLM-4.5-MoE, dots1, EXAONE-MoE, ... routers). Routers without one "
            "(Mixtral, Qwen3-MoE, GPT-OSS) have nothing to update: auxiliary-loss-free balancing is not built for "
            "them; remove the key")
    logger.info(f"expert_parallel: auxiliary-loss-free balancing of {len(routers)} router(s), bias update speed "
                f"{coeff:g} per optimizer step")
    return ExpertBiasBalance(routers, coeff, comm)
