"""Run every differential case under one engine (DeepSpeed or zeroshard) and write JSON records.

Launched by `harness.py` as
    torchrun --standalone --nproc-per-node=2 tests/differential/worker.py --engine ds|zs --out F.json
Each rank trains the same cases in the same order; rank 0 writes, after each case, a JSON
file with per-step records (loss averaged over ranks and micro-batches, lr and betas/momentum
per param group, pre-clip global grad norm, loss scale, skipped steps), the same records for the
resumed run (fresh engine, load the step-SAVE_AT checkpoint, continue), and the final fp32
master weights (saved next to the JSON as a torch file). An exception in a case is recorded
and the next case runs (a config error raises on every rank alike).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import BY_NAME, CASES, SAVE_AT, STEPS, WORLD_SIZE, Case

from zeroshard.examples.gpt import GPT, CharDataset, GPTConfig, load_corpus

SEED = 1234
MODEL = GPTConfig.preset("tiny")


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return GPT(MODEL)


def client_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    raise ValueError(f"unknown client optimizer {kind!r}")


class Data:
    """Batch for (optimizer step, micro-batch, rank): disjoint corpus windows, same on both engines."""

    def __init__(self) -> None:
        self.ds = CharDataset(load_corpus(), MODEL.block_size)

    def batch(self, step: int, micro: int, rank: int, gas: int, mb: int) -> tuple[Tensor, Tensor]:
        first = ((step * gas + micro) * WORLD_SIZE + rank) * mb
        items = [self.ds[(first + i) % len(self.ds)] for i in range(mb)]
        return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


# -- the two engines behind one small interface ----------------------------------------------


class Engine:
    name = ""

    def initialize(self, model: nn.Module, case: Case) -> Any:
        raise NotImplementedError

    def loss_scale(self, engine: Any) -> float | None:
        raise NotImplementedError

    def final_weights(self, engine: Any, ckpt_dir: str) -> dict[str, Tensor] | None:
        raise NotImplementedError


class DeepSpeedEngine(Engine):
    name = "ds"

    def __init__(self) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
        # DeepSpeed refuses fp16 on a CPU without AVX512-FP16/AMX; this process only says yes.
        get_accelerator().is_fp16_supported = lambda: True
        self.ds = deepspeed
        deepspeed.init_distributed(dist_backend="gloo")

    def initialize(self, model: nn.Module, case: Case) -> Any:
        opt = client_optimizer(case.client_optimizer, model) if case.client_optimizer else None
        engine, *_ = self.ds.initialize(model=model, model_parameters=model.parameters(),
                                        optimizer=opt, config=json.loads(json.dumps(case.config)))
        return engine

    def loss_scale(self, engine: Any) -> float | None:
        if not engine.fp16_enabled():
            return None
        opt = engine.optimizer
        # ZeRO optimizers expose cur_scale; stage 0's FP16_Optimizer keeps it in its config.
        scale = getattr(opt, "cur_scale", None)
        return float(scale if scale is not None else opt.loss_scale_config.cur_scale)

    def final_weights(self, engine: Any, ckpt_dir: str) -> dict[str, Tensor] | None:
        from deepspeed.utils import safe_get_full_fp32_param

        out: dict[str, Tensor] = {}
        opt = engine.optimizer
        flat_fallback: dict[int, Tensor] = {}
        if hasattr(opt, "fp32_groups_flat") and hasattr(opt, "fp16_groups"):
            # Stage 0 fp16 (FP16_Optimizer): the masters are one flat fp32 buffer per group.
            for flat, group in zip(opt.fp32_groups_flat, opt.fp16_groups):
                for p, t in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                    flat_fallback[id(p)] = t
        for name, p in engine.module.named_parameters():
            full = safe_get_full_fp32_param(p)  # collective at stage 3: every rank calls it
            if full is None:
                full = flat_fallback.get(id(p), p.detach() if p.dtype == torch.float32 else None)
            if full is None:
                raise AssertionError(f"no fp32 master for {name}")
            out[name] = full.detach().float().cpu().clone()
        return out


class ZeroshardEngine(Engine):
    name = "zs"

    def __init__(self) -> None:
        import zeroshard
        from zeroshard.checkpoint.to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        self.zs = zeroshard
        self.to_fp32 = get_fp32_state_dict_from_zero_checkpoint

    def initialize(self, model: nn.Module, case: Case) -> Any:
        opt = client_optimizer(case.client_optimizer, model) if case.client_optimizer else None
        engine, *_ = self.zs.initialize(model=model, model_parameters=model.parameters(),
                                        optimizer=opt, config=json.loads(json.dumps(case.config)))
        return engine

    def loss_scale(self, engine: Any) -> float | None:
        # fp16_enabled() is DeepSpeed's name (issue 9 item 4); older engines: the typed config.
        fp16 = engine.fp16_enabled() if hasattr(engine, "fp16_enabled") else engine.config.fp16.enabled
        return float(engine.get_loss_scale()) if fp16 else None

    def final_weights(self, engine: Any, ckpt_dir: str) -> dict[str, Tensor] | None:
        engine.save_checkpoint(ckpt_dir, tag="end")
        dist.barrier()
        sd = self.to_fp32(ckpt_dir, tag="end") if dist.get_rank() == 0 else {}
        return {k: v.float().cpu().clone() for k, v in sd.items()}


# -- one case ------------------------------------------------------------------------------


def _mean_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def _momenta(engine: Any) -> list[list[float] | float | None]:
    out: list[list[float] | float | None] = []
    for g in engine.optimizer.param_groups:
        if "betas" in g:
            out.append([float(b) for b in g["betas"]])
        else:
            out.append(float(g["momentum"]) if "momentum" in g else None)
    return out


def _norm(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value.item() if isinstance(value, Tensor) else value)
    return value if math.isfinite(value) else str(value)  # type: ignore[return-value]


def train(engine: Any, which: Engine, data: Data, steps: range, case: Case) -> list[dict[str, Any]]:
    gas = engine.gradient_accumulation_steps()
    mb = engine.train_micro_batch_size_per_gpu()
    rank = dist.get_rank()
    records = []
    for step in steps:
        losses = []
        for micro in range(gas):
            x, y = data.batch(step, micro, rank, gas, mb)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach().float().item()))
        records.append({
            "step": step + 1,
            "loss": _mean_over_ranks(sum(losses) / len(losses)),
            "lr": [float(v) for v in engine.get_lr()],
            "betas": _momenta(engine),
            "grad_norm": _norm(engine.get_global_grad_norm()),
            "loss_scale": which.loss_scale(engine),
            "skipped": int(engine.skipped_steps),
            "global_steps": int(engine.global_steps),
        })
    return records


def run_case(case: Case, which: Engine, data: Data, root: str) -> dict[str, Any]:
    ckpt = os.path.join(root, case.name)
    engine = which.initialize(build_model(SEED), case)
    out: dict[str, Any] = {"train_batch_size": engine.train_batch_size(),
                           "gas": engine.gradient_accumulation_steps()}
    out["steps"] = train(engine, which, data, range(SAVE_AT), case)
    engine.save_checkpoint(ckpt, tag="mid")
    out["steps"] += train(engine, which, data, range(SAVE_AT, STEPS), case)
    weights = which.final_weights(engine, ckpt)
    del engine
    # Resume: a fresh model with different initial weights, so only the checkpoint can match.
    fresh = which.initialize(build_model(SEED + 1), case)
    fresh.load_checkpoint(ckpt, tag="mid")
    out["resumed"] = train(fresh, which, data, range(SAVE_AT, STEPS), case)
    del fresh
    out["_weights"] = weights
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["ds", "zs"], required=True)
    ap.add_argument("--out", required=True, help="JSON file (weights go to OUT.weights.pt)")
    ap.add_argument("--cases", nargs="*", help="case names (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.engine == "zs":
        import datetime
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    which: Engine = DeepSpeedEngine() if args.engine == "ds" else ZeroshardEngine()
    logging.getLogger("zeroshard").setLevel(logging.WARNING)
    cases = [BY_NAME[n] for n in args.cases] if args.cases else CASES
    data = Data()
    rank = dist.get_rank()
    root = tempfile.mkdtemp(prefix=f"diff_{args.engine}_") if rank == 0 else ""
    box = [root]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    # A run of some cases updates an earlier run's records (harness.py --cases ...).
    out = Path(args.out)
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    wfile = Path(args.out + ".weights.pt")
    weights: dict[str, dict[str, Tensor]] = torch.load(wfile) if wfile.exists() else {}
    for case in cases:
        start = time.perf_counter()
        weights.pop(case.name, None)
        try:
            rec = run_case(case, which, data, root)
            w = rec.pop("_weights")
            if rank == 0 and w:
                weights[case.name] = w
        except Exception as exc:  # recorded, the table shows it
            rec = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:400],
                   "traceback": traceback.format_exc()[-3000:]}
        rec["seconds"] = round(time.perf_counter() - start, 2)
        results[case.name] = rec
        if rank == 0:
            print(f"[{args.engine}] {case.name}: {rec.get('error', 'ok')} ({rec['seconds']} s)", flush=True)
            out.write_text(json.dumps(results, indent=1))
            torch.save(weights, wfile)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
