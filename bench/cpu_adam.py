"""CPU optimizer step: torch's fused and foreach AdamW vs DeepSpeed's DeepSpeedCPUAdam.

    python bench/cpu_adam.py            # ~1-2 min; rewrites the cpu_adam section of results.md
    python bench/cpu_adam.py --repeats 50

This is the kernel ZeRO-Offload runs on the CPU-resident fp32 master shard every step (zeroshard
uses torch.optim.AdamW(fused=True), DeepSpeed its own AVX kernel). Same fp32 tensors, same
gradients, same hyper-parameters (AdamW, lr 1e-3, weight decay 0.01); time per step is the
median of --repeats steps after warm-up. Each thread count runs in its own process with
OMP_NUM_THREADS and torch.set_num_threads set, so torch and DeepSpeed's OpenMP see the same
count. Before timing, every optimizer runs 3 steps from the same start and the parameters are
compared with the fused AdamW's (so the timings are of the same computation).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

BENCH = Path(__file__).resolve().parent
HP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
BYTES_PER_ELEMENT = 7 * 4  # fp32: read param, grad, m, v; write param, m, v


def layouts() -> dict[str, list[tuple[int, ...]]]:
    """Name -> list of tensor shapes. "gpt25m" is the benchmark model's own parameter shapes."""
    sys.path.insert(0, str(BENCH))
    from engines.common import RunSpec, build_model

    gpt = [tuple(p.shape) for p in build_model(RunSpec()).parameters()]
    return {
        "1M flat": [(1_000_000,)],
        "10M flat": [(10_000_000,)],
        "25M flat": [(25_000_000,)],
        f"GPT 25m ({len(gpt)} tensors)": gpt,
        "10M as 1000 x 10K": [(10_000,)] * 1000,
    }


def make_optimizers() -> dict[str, Callable[[list[Any]], Any]]:
    import torch

    opts: dict[str, Callable[[list[Any]], Any]] = {
        "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, fused=True, **HP),
        "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **HP),
    }
    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opts["DeepSpeedCPUAdam"] = lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=True, **HP)
    except Exception as e:  # reported as a missing column
        print(f"[cpu_adam] DeepSpeedCPUAdam unavailable: {type(e).__name__}: {e}", file=sys.stderr)
    return opts


def fresh(shapes: list[tuple[int, ...]], seed: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g) * 0.02)
        p.grad = torch.randn(s, generator=g) * 1e-3
        params.append(p)
    return params


def agreement(shapes: list[tuple[int, ...]], opts: dict[str, Callable]) -> dict[str, float]:
    """Max |param - fused AdamW's param| after 3 identical steps, in units of lr."""
    import torch

    ref = None
    out = {}
    for name, make in opts.items():
        ps = fresh(shapes, seed=0)
        opt = make(ps)
        for _ in range(3):
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in ps])
        if ref is None:
            ref = flat
        out[name] = float((flat - ref).abs().max()) / HP["lr"]
        del opt, ps
    return out


def time_interleaved(shapes: list[tuple[int, ...]], opts: dict[str, Callable], repeats: int,
                     warmup: int) -> dict[str, float]:
    """Median seconds per step of each optimizer, stepping them in turn (A, B, C, A, B, C, ...)
    so a burst of machine noise hits all of them alike."""
    built = {}
    for name, make in opts.items():
        ps = fresh(shapes, seed=1)
        built[name] = make(ps)
        for _ in range(warmup):
            built[name].step()
    times: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(repeats):
        for name, opt in built.items():
            t = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def child(threads: int, repeats: int, warmup: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    opts = make_optimizers()
    result: dict[str, Any] = {"threads": threads, "rows": []}
    for name, shapes in layouts().items():
        numel = sum(int(torch.Size(s).numel()) for s in shapes)
        row = {"layout": name, "numel": numel, "max_diff_lr": agreement(shapes, opts),
               "ms": {k: v * 1e3 for k, v in time_interleaved(shapes, opts, repeats, warmup).items()}}
        result["rows"].append(row)
        print(f"[cpu_adam] {threads} thread(s) {name}: "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in row["ms"].items()), file=sys.stderr, flush=True)
    return result


def render(results: list[dict[str, Any]], args: argparse.Namespace, total_s: float) -> str:
    sys.path.insert(0, str(BENCH))
    import datetime as dt

    from run import machine, versions  # bench/run.py's header helpers

    ds = "DeepSpeedCPUAdam"
    L = [f"Measured {dt.datetime.now().strftime('%Y-%m-%d %H:%M')} by `python bench/cpu_adam.py` "
         f"in {total_s:.0f} s. {machine()}; {versions()}.", "",
         f"fp32 params, AdamW (lr {HP['lr']:g}, weight decay {HP['weight_decay']:g}); median of "
         f"{args.repeats} steps after {args.warmup} warm-up steps, the optimizers stepping in turn. "
         f"GB/s counts {BYTES_PER_ELEMENT} bytes per element (read param, grad, m, v; write param, m, v). "
         "'vs DS' is DeepSpeedCPUAdam's time / this one's (> 1: faster than DeepSpeed). "
         "Max diff: largest |param - fused AdamW's param| after 3 identical steps, in units of lr.", "",
         "Others' CPU (share of the cores used by other processes meanwhile): "
         + ", ".join(f"{r['threads']} thread(s) {r.get('others_cpu', 0):.0%}" for r in results) + ".", "",
         "| threads | tensors | optimizer | ms / step | GB/s | vs DS | max diff (x lr) |",
         "|---:|---|---|---:|---:|---:|---:|"]
    for res in results:
        for row in res["rows"]:
            ds_ms = row["ms"].get(ds)
            for oname, ms in row["ms"].items():
                gbs = row["numel"] * BYTES_PER_ELEMENT / (ms / 1e3) / 1e9
                vs = f"{ds_ms / ms:.2f}" if ds_ms else "–"
                diff = row["max_diff_lr"].get(oname)
                L.append(f"| {res['threads']} | {row['layout']} | {oname} | {ms:.2f} | {gbs:.1f} | {vs} "
                         f"| {diff:.1e} |")
    return "\n".join(L)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--results", type=Path, default=BENCH / "results.md")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.threads[0], args.repeats, args.warmup)))
        return 0
    t0 = time.perf_counter()
    results = []
    from run import OthersCpu, wait_idle

    for n in args.threads:
        wait_idle(60.0)
        meter = OthersCpu()
        env = dict(os.environ, OMP_NUM_THREADS=str(n), DS_ACCELERATOR="cpu")
        out = subprocess.run([sys.executable, __file__, "--child", "--threads", str(n),
                              "--repeats", str(args.repeats), "--warmup", str(args.warmup)],
                             env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]) | {"others_cpu": meter.share()})
    body = render(results, args, time.perf_counter() - t0)
    from run import write_section

    write_section(args.results, "cpu_adam", body, "CPU Adam step (bench/cpu_adam.py)")
    raw = BENCH / "out" / "cpu_adam.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(results, indent=1))
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
