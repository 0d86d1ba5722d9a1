"""A GPT whose model states do not fit in this machine's RAM, trained at stage 3 with the
parameters and the optimizer states on NVMe (issue 14; results in bench/nvme.md).

    python bench/nvme_big.py /work/nvme_scratch/big [--n-layer 30] [--n-embd 2048] [--steps 3]

One process (world size 1), fp32. Model states: 4 bytes of parameters + 4 of gradients + 12 of
Adam (master, exp_avg, exp_avg_sq) per parameter; with the defaults (1.51B parameters) that is
30 GB against the machine's 24 GiB. Prints the loss and time of each step, the peak RSS and the
disk space the swap files take.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import time
from pathlib import Path

import torch

import zeroshard
from zeroshard.examples.gpt import GPT, GPTConfig


def du(path: Path) -> int:
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("nvme_path", type=Path)
    ap.add_argument("--n-layer", type=int, default=30)
    ap.add_argument("--n-embd", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-in-cpu", type=float, default=2e8)
    args = ap.parse_args()
    args.nvme_path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=args.seq, n_layer=args.n_layer, n_head=args.n_embd // 128, n_embd=args.n_embd)
    nvme = {"device": "nvme", "nvme_path": str(args.nvme_path)}
    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "sub_group_size": 50_000_000,
                              "offload_optimizer": {**nvme, "buffer_count": 4},
                              "offload_param": {**nvme, "max_in_cpu": int(args.max_in_cpu)}},
    }
    t0 = time.perf_counter()
    with zeroshard.zero.Init(config_dict_or_path=config):
        model = GPT(cfg)
    n = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    setup = time.perf_counter() - t0
    states = 20 * n
    ram = int(open("/proc/meminfo").read().split("MemTotal:")[1].split()[0]) * 1024
    print(f"NVME_BIG params={n / 1e9:.3f}B model_states={states / 2**30:.1f}GiB ram={ram / 2**30:.1f}GiB "
          f"setup_s={setup:.0f}", flush=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.block_size + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    for step in range(args.steps):
        t = time.perf_counter()
        loss = engine(x, y)  # the built-in GPT returns the loss when given targets
        engine.backward(loss)
        engine.step()
        disk = du(args.nvme_path)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(f"NVME_BIG step={step + 1} loss={loss.item():.4f} step_s={time.perf_counter() - t:.1f} "
              f"peak_rss={peak / 2**30:.2f}GiB swap_disk={disk / 2**30:.1f}GiB", flush=True)


if __name__ == "__main__":
    main()
