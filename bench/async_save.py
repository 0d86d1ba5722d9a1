"""Step time while saving every N steps: never, synchronous, asynchronous (issue 42 item 3).

    OMP_NUM_THREADS=1 python bench/async_save.py [--every 5] [--steps 20] [--passes 4] [--worlds 1 2]

The driver starts one torchrun job per world size; each job builds three engines from one seed
(no saves; `checkpoint.save_interval_steps` N with `async_save` false; the same with true, both
with `keep_last` 2) and times PASSES runs of STEPS optimizer steps of each, in alternating order
never, sync, async, async, sync, never, ... (drift on a shared machine falls on every mode alike),
and reports each mode's median pass. A pass's time per step
is its wall time over the steps, the saves' share included, and for async the final join
(`wait_for_checkpoint`), so nothing it owes is left outside the clock. Ratios are against
`never` within the same job. Checkpoints go to a fresh directory on the root file system
(fsync is real there; /dev/shm would hide it), removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SHAPE = {"vocab_size": 256, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 256, "dropout": 0.0}
MICRO = 4
MODES = ("never", "sync", "async")


def _config(mode: str, every: int, root: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2},
    }
    if mode != "never":
        cfg["checkpoint"] = {"async_save": mode == "async", "save_dir": str(root / mode),
                             "save_interval_steps": every, "keep_last": 2}
    return cfg


def _worker(args: argparse.Namespace) -> None:
    import zeroshard
    from zeroshard.examples.gpt import GPT, GPTConfig

    rank = zeroshard.init_distributed().rank
    torch.set_num_threads(1)
    root = Path(args.dir)
    engines = {}
    for mode in MODES:
        torch.manual_seed(0)
        engines[mode], *_ = zeroshard.initialize(model=GPT(GPTConfig(**SHAPE)), config=_config(mode, args.every, root))
    g = torch.Generator().manual_seed(rank)
    data = torch.randint(0, SHAPE["vocab_size"], (8, MICRO, SHAPE["block_size"] + 1), generator=g)

    def run(engine: Any, steps: int) -> float:
        start = time.perf_counter()
        for i in range(steps):
            batch = data[i % len(data)]
            engine.backward(engine(batch[:, :-1], batch[:, 1:]))
            engine.step()
        engine.wait_for_checkpoint()
        return time.perf_counter() - start

    for mode in MODES:  # warm-up: first-touch allocations, the first snapshot's buffers, one save each
        run(engines[mode], args.every)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for p in range(args.passes):
        for mode in MODES if p % 2 == 0 else tuple(reversed(MODES)):
            times[mode].append(run(engines[mode], args.steps) / args.steps)
    state_mb = sum(t.numel() * t.element_size() for s in [engines["sync"].state()]
                   for t in [*s.masters, *(v for d in s.optimizer_states for v in d.values()
                                            if isinstance(v, torch.Tensor))]) / 2**20
    if rank == 0:
        per_step = {m: statistics.median(v) for m, v in times.items()}
        Path(args.out).write_text(json.dumps({"per_step_s": per_step, "runs": times, "state_mib_rank0": state_mb}))


def _drive(args: argparse.Namespace) -> None:
    rows = []
    for world in args.worlds:
        root = Path(tempfile.mkdtemp(prefix="zeroshard-async-bench-", dir="/var/tmp"))
        out = root / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               __file__, "--worker", "--dir", str(root), "--out", str(out), "--every", str(args.every),
               "--steps", str(args.steps), "--passes", str(args.passes)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
        shutil.rmtree(root, ignore_errors=True)
        rows.append((world, result))
    print(f"save every {args.every} steps, {args.steps} steps per pass, {args.passes} passes per mode in alternating "
          f"order (never, sync, async, async, sync, never, ...), median; model {SHAPE}, micro-batch {MICRO}, "
          "ZeRO 2, fp32, CPU\n")
    print("| world size | optimizer state + master per rank (MiB) | never (ms/step) | sync (ms/step) | async (ms/step) "
          "| sync / never | async / never |")
    print("|---|---|---|---|---|---|---|")
    for world, r in rows:
        s = r["per_step_s"]
        print(f"| {world} | {r['state_mib_rank0']:.1f} | {s['never'] * 1e3:.1f} | {s['sync'] * 1e3:.1f} | "
              f"{s['async'] * 1e3:.1f} | {s['sync'] / s['never']:.3f} | {s['async'] / s['never']:.3f} |")
    print("\nper pass (ms/step): " + "; ".join(
        f"world {w}: " + ", ".join(f"{m} " + "/".join(f"{t * 1e3:.0f}" for t in r["runs"][m]) for m in MODES)
        for w, r in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, default=5, help="save every this many optimizer steps")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode and pass")
    parser.add_argument("--passes", type=int, default=4, help="timed passes per mode (alternating order)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
    else:
        _drive(args)


if __name__ == "__main__":
    main()
