"""Activation memory and step time with and without activation checkpointing, at every stage.

    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=65536 torchrun --standalone --nproc-per-node=2 \
        bench/activation_checkpointing.py [--out results.json]

Peak activation memory on CPU is the peak RSS during forward + backward above the RSS between
steps: Linux's high-water mark (VmHWM) is reset through /proc/self/clear_refs before the
forward and read after the backward. A fixed malloc mmap threshold makes freed activations
leave the RSS at once (glibc otherwise adapts the threshold and keeps them in its heap). The
estimate is zeroshard.estimate.activations.activation_bytes for the same shape and options.
On a GPU (when run there) torch.cuda.max_memory_allocated replaces the RSS.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import zeroshard
import zeroshard.checkpointing as ckpt
from zeroshard.estimate.activations import ActivationOptions, activation_bytes
from zeroshard.estimate.spec import spec_from_gpt
from zeroshard.examples.gpt import GPT, GPTConfig

SHAPE = {"vocab_size": 256, "block_size": 256, "n_layer": 8, "n_head": 8, "n_embd": 256, "dropout": 0.0}
MICRO = 8
STAGES: dict[int, dict[str, Any]] = {
    0: {"stage": 0}, 1: {"stage": 1}, 2: {"stage": 2},
    # Keep at most one block gathered beyond the one in use, so gathered parameters do not
    # pass for activations.
    3: {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 1_000_000},
}


class CheckpointedGPT(GPT):
    def __init__(self, cfg: GPTConfig, checkpointing: bool) -> None:
        super().__init__(cfg)
        self.checkpointing = checkpointing

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = ckpt.checkpoint(block, x) if self.checkpointing else block(x)
        logits = self.lm_head(self.ln_f(x))
        assert targets is not None
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak(device: torch.device) -> int:
    """Start a peak measurement; returns the current level in bytes."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _status_kib("VmHWM") * 1024


def measure(stage: int, checkpointing: bool, steps: int, warmup: int) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = GPTConfig(**SHAPE)
    model = CheckpointedGPT(cfg, checkpointing)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": STAGES[stage]}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(engine.rank)
    peaks, times = [], []
    for i in range(warmup + steps):
        tokens = torch.randint(0, cfg.vocab_size, (MICRO, cfg.block_size + 1), generator=g).to(engine.device)
        base = _reset_peak(engine.device)
        start = time.perf_counter()
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        peak = _peak(engine.device)
        engine.step()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            peaks.append(peak - base)
            times.append(elapsed)
    est = activation_bytes(spec_from_gpt(SHAPE).shape, ActivationOptions(
        seq_len=cfg.block_size, micro_batch=MICRO, checkpointing=checkpointing, act_bytes=4, dropout=False))
    del engine, model
    gc.collect()
    return {"stage": stage, "checkpointing": checkpointing, "measured_bytes": int(statistics.median(peaks)),
            "estimated_bytes": est, "step_s": statistics.median(times)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--stages", dest="zero_stages", default="0,1,2,3")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for stage in (int(s) for s in args.zero_stages.split(",")):
        for on in (False, True):
            rows.append(measure(stage, on, args.steps, args.warmup))
    groups = zeroshard.init_distributed()
    if groups.rank != 0:
        return
    print("| stage | checkpointing | peak activations measured | estimated | measured / estimated | step time |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stage']} | {'on' if r['checkpointing'] else 'off'} | {r['measured_bytes'] / 2**20:.1f} MiB "
              f"| {r['estimated_bytes'] / 2**20:.1f} MiB | {r['measured_bytes'] / r['estimated_bytes']:.3f} "
              f"| {1000 * r['step_s']:.0f} ms |")
    for stage in sorted({r["stage"] for r in rows}):
        off, on = (next(r for r in rows if r["stage"] == stage and r["checkpointing"] is c) for c in (False, True))
        saved_m = off["measured_bytes"] - on["measured_bytes"]
        saved_e = off["estimated_bytes"] - on["estimated_bytes"]
        print(f"stage {stage}: reduction measured {saved_m / 2**20:.1f} MiB, estimated {saved_e / 2**20:.1f} MiB "
              f"({saved_m / saved_e:.3f}); step time x{on['step_s'] / off['step_s']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
