"""The generated DeepSpeed-checkpoint matrix (issue 24): parameter sets, their model, data and config.

Imports neither DeepSpeed nor zeroshard's runtime: DeepSpeed (ds_matrix_gen.py) and zeroshard
(ds_matrix_load.py) build the same model from a case name and take the same ds_config dict.

A case is `<set>-w<W>-s<S>-<precision>[-off]`: parameter set, the world size DeepSpeed saves at,
its ZeRO stage, precision, CPU offload. The sets are generated so that DeepSpeed's ZeRO-1/2 flat
buffer needs alignment padding (to a multiple of 2 * W elements) at every W, and so that
partition boundaries fall inside parameters, one element from their ends:
- odd: odd sizes, a 2-D one; prime: prime sizes; tiny: parameters smaller than the world size
  (whole partitions are padding); straddle: every partition boundary r * P cuts a 2-element
  parameter [rP - 1, rP + 1) and the tail ends 3 elements short of W * P (so no feature may
  change its flat buffer but a tie).
Features rotate over the sets: a frozen parameter, a tied one (two module names, one tensor),
two parameter groups, and DeepSpeed's round-robin gradient order at stages 1/2.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch import Tensor, nn

J, STEPS, GLOBAL_BATCH, D = 2, 3, 12, 8
"""Steps before the save, steps continued, samples per global batch (divisible by 1-4 ranks)."""

SETS = ("odd", "prime", "tiny", "straddle")
FEATURES = {"odd": ("frozen", "groups"), "prime": ("tied", "round_robin"), "tiny": ("frozen", "tied"),
            "straddle": ("tied",)}
WORLDS, STAGES, PRECISIONS = (2, 3, 4), (1, 2, 3), ("fp32", "bf16", "fp16")


def shapes(name: str, world: int) -> list[tuple[int, ...]]:
    """The parameter shapes of set `name` as DeepSpeed saves it at `world` ranks."""
    if name == "odd":
        return [(3, 5), (7,), (1,), (9, 11), (13,)]
    if name == "prime":
        return [(97,), (101,), (11, 13), (2,), (3,)]
    if name == "tiny":
        return [(1,), (1,), (2,), (1,)]
    # straddle: P = 12 per partition, the flat numel W * 12 - 3 (padding 3 < 2W)
    part, cuts = 12, [0]
    for r in range(1, world):
        cuts += [r * part - 1, r * part + 1]
    cuts.append(world * part - 3)
    sizes = [b - a for a, b in itertools.pairwise(cuts)]
    return [(s // 2, 2) if s % 2 == 0 and s > 2 else (s,) for s in sizes]


def all_cases() -> list[str]:
    """The full matrix: every set at every world, stage and precision; CPU offload on half of
    them, rotating so every (stage, precision) meets both."""
    out = []
    for w, s, p in itertools.product(WORLDS, STAGES, PRECISIONS):
        for k, name in enumerate(SETS):
            off = (k + s + PRECISIONS.index(p)) % 2 == 1
            out.append(f"{name}-w{w}-s{s}-{p}{'-off' if off else ''}")
    return out


def parse(case: str) -> tuple[str, int, int, str, bool]:
    parts = case.split("-")
    return parts[0], int(parts[1][1:]), int(parts[2][1:]), parts[3], "off" in parts[4:]


class Leaf(nn.Module):
    """One parameter; its term is tanh(<w, x[idx]>) with idx = arange(numel) % D."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(shape) * 0.5)

    def forward(self, x: Tensor) -> Tensor:
        flat = self.w.reshape(-1)
        idx = torch.arange(flat.numel()) % x.shape[-1]
        return torch.tanh((x[:, idx].to(flat.dtype) * flat).sum(-1) / math.sqrt(flat.numel()))


class ParamSet(nn.Module):
    def __init__(self, name: str, world: int, features: tuple[str, ...]) -> None:
        super().__init__()
        self.leaves = nn.ModuleList(Leaf(s) for s in shapes(name, world))
        if "tied" in features:  # a second module holding the first leaf's parameter (one tensor)
            self.tie = Leaf(shapes(name, world)[0])
            self.tie.w = self.leaves[0].w

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        terms = [leaf(x) for leaf in self.leaves]
        if hasattr(self, "tie"):
            terms.append(0.5 * self.tie(x.flip(-1)))
        out = torch.stack(terms, -1).sum(-1)
        return ((out.float() - y) ** 2).mean()


def make_model(case: str, seed: int = 0) -> ParamSet:
    name, world, _, _, _ = parse(case)
    torch.manual_seed(seed)
    model = ParamSet(name, world, FEATURES[name])
    if "frozen" in FEATURES[name]:
        model.leaves[1].w.requires_grad_(False)
    return model


def model_parameters(model: ParamSet, case: str) -> list[Any]:
    params = [p for p in model.parameters() if p.requires_grad]
    if "groups" not in FEATURES[parse(case)[0]]:
        return params
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.01},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]


def batches(seed: int = 1) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, D, generator=g), torch.randn(GLOBAL_BATCH, generator=g))
            for _ in range(J + STEPS)]


def ds_config(case: str, world: int, stage: int | None = None) -> dict[str, Any]:
    """The config of `case` at `world` ranks (`stage`: override the ZeRO stage, for zeroshard)."""
    name, _, saved_stage, precision, offload = parse(case)
    stage = saved_stage if stage is None else stage
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 64}
    if stage in (1, 2):
        zero["allgather_bucket_size"] = 64
        if "round_robin" in FEATURES[name]:
            zero["round_robin_gradients"] = True
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 4
    if offload and stage > 0:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GLOBAL_BATCH // world,
        "gradient_clipping": 1.0, "steps_per_print": 1000, "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 3}},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000}
    return cfg


def step_losses(engine: Any, data: list[tuple[Tensor, Tensor]], rank: int, world: int) -> list[float]:
    """Train over `data` (global batches, micro-batch 1); the global-mean loss of each step."""
    out = []
    gas = GLOBAL_BATCH // world
    for x, y in data:
        total = 0.0
        for m in range(gas):
            i = m * world + rank
            loss = engine(x[i : i + 1], y[i : i + 1])
            engine.backward(loss)
            engine.step()
            total += float(loss.float().item()) / gas
        if world > 1:
            import torch.distributed as dist

            t = torch.tensor([total], dtype=torch.float64)
            dist.all_reduce(t)
            total = float(t.item()) / world
        out.append(total)
    return out
