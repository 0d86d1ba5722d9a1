"""GPU benchmark: zeroshard stages 0-3 (+ offload) against DeepSpeed 0.19 and FSDP2 on one machine.

    python bench/gpu/run.py                         # every row, ~1.2B GPT, bf16, all visible GPUs
    python bench/gpu/run.py --rows zs3 ds3 fsdp2    # some rows
    python bench/gpu/run.py --smoke                 # the harness on a CPU: tiny model, zeroshard + FSDP2

Each row is a fresh torchrun job (bench/gpu/runner.py) so no engine inherits another's allocator
state. The table (bench/gpu/results.md) gives tokens/s, model FLOPs utilisation against the
GPU's dense bf16 peak, peak `torch.cuda.max_memory_allocated`, time to first step, and the
ratios the goals are stated in: each zeroshard row against DeepSpeed's same stage (throughput
>= 1, memory <= 1) and stage 3 against FSDP2 (>= 0.9). The machine (GPU, driver, CUDA, NCCL,
torch, DeepSpeed) is recorded with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from runner import ROWS, GpuSpec  # noqa: E402  bench/gpu/runner.py loads after the sys.path insert

# The NVMe rows, the optimizer-only CPU offload row they are measured against and the delayed-update
# rows run by name.
DEFAULT_ROWS = [r for r in ROWS if "nvme" not in r and "delayed" not in r and r != "zs3_offload_opt"]

# Dense bf16 tensor-core peaks (TFLOP/s) from the vendors' data sheets, by device-name substring.
PEAK_BF16_TFLOPS = [("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0),
                    ("L40S", 362.1), ("A10G", 70.0)]


def peak_tflops(gpu: str | None, override: float | None) -> float | None:
    if override:
        return override
    for name, peak in PEAK_BF16_TFLOPS:
        if gpu and name in gpu:
            return peak
    return None


def run_row(row: str, spec: GpuSpec, nproc: int, out_dir: Path, timeout_s: int) -> dict[str, Any]:
    out = out_dir / f"{row}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(HERE / "runner.py"), "--engine", row, "--spec", json.dumps(spec.__dict__), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        tail = (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        return {"row": row, "status": "timeout", "message": f"over {timeout_s} s"}
    if not out.exists():
        return {"row": row, "status": "error", "message": f"no result (exit {proc.returncode}): {tail}"}
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - t
    return result


def render(results: list[dict[str, Any]], peak: float | None) -> str:
    by_row = {r["row"]: r for r in results}
    ok = [r for r in results if r.get("status") == "ok"]
    m = ok[0] if ok else (results[0] if results else {})
    lines = [
        "# GPU benchmark results",
        "",
        f"Machine: {m.get('gpu', 'no GPU')} ({m.get('gpu_memory_gib', '?')} GiB), driver "
        f"{m.get('driver', '?')}, CUDA {m.get('cuda')}, NCCL {m.get('nccl', '?')}, torch {m.get('torch')}, "
        f"DeepSpeed {m.get('deepspeed')}; world size {m.get('world_size', '?')}; "
        f"dense bf16 peak used for MFU: {peak if peak else 'unknown'} TFLOP/s.",
        "",
        f"Spec: `{json.dumps(m.get('spec', {}))}`",
        "",
        "| row | status | tokens/s | MFU | peak allocated GiB | first step s "
        "| vs DeepSpeed (speed / memory) | vs FSDP2 |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        row = r["row"]
        if r.get("status") != "ok":
            lines.append(f"| {row} | {r.get('status')}: {r.get('message', '')[:120]} | | | | | | |")
            continue
        mfu = f"{r['achieved_tflops'] / peak:.1%}" if peak else "n/a"
        mem = r.get("peak_allocated_bytes")
        ds = by_row.get(row.replace("zs", "ds")) if row.startswith("zs") else None
        vs_ds = ""
        if ds and ds.get("status") == "ok":
            mem_ratio = f"{mem / ds['peak_allocated_bytes']:.2f}" if mem and ds.get("peak_allocated_bytes") else "n/a"
            vs_ds = f"{r['tokens_per_s'] / ds['tokens_per_s']:.2f} / {mem_ratio}"
        fs = by_row.get("fsdp2")
        vs_fs = f"{r['tokens_per_s'] / fs['tokens_per_s']:.2f}" if fs and fs.get("status") == "ok" else ""
        lines.append(f"| {row} | ok | {r['tokens_per_s']:.0f} | {mfu} | "
                     f"{mem / 2**30:.2f} | {r['time_to_first_step_s']:.1f} | {vs_ds} | {vs_fs} |"
                     if mem is not None else
                     f"| {row} | ok | {r['tokens_per_s']:.0f} | {mfu} | n/a (CPU) | "
                     f"{r['time_to_first_step_s']:.1f} | {vs_ds} | {vs_fs} |")
    for nvme, cpu in (("zs2_nvme", "zs2_offload"), ("zs3_nvme", "zs3_offload_opt")):
        a, b = by_row.get(nvme, {}), by_row.get(cpu, {})
        if a.get("status") == b.get("status") == "ok":
            lines.append(f"\n{nvme} against {cpu} (NVMe over CPU optimizer offload, throughput): "
                         f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}")
    for delayed, sync, plain in (("zs2_offload_delayed", "zs2_offload", "zs2"),
                                 ("zs3_offload_delayed", "zs3_offload_opt", "zs3")):
        a, b, c = by_row.get(delayed, {}), by_row.get(sync, {}), by_row.get(plain, {})
        if a.get("status") == "ok" and b.get("status") == "ok":
            line = (f"\n{delayed} against {sync} (delayed update over synchronous CPU optimizer offload, "
                    f"throughput): {a['tokens_per_s'] / b['tokens_per_s']:.2f}")
            if c.get("status") == "ok":
                line += f"; against {plain} (no offload): {a['tokens_per_s'] / c['tokens_per_s']:.2f}"
            lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, choices=sorted(ROWS))
    p.add_argument("--nproc", type=int, default=None, help="processes (default: visible GPUs, or 1)")
    p.add_argument("--spec", default="{}", help="GpuSpec overrides as JSON, e.g. '{\"micro_batch\": 4}'")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, zeroshard + FSDP2 rows only")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "out" / "gpu")
    p.add_argument("--results", type=Path, default=HERE / "results.md")
    p.add_argument("--timeout-s", type=int, default=1200)
    args = p.parse_args(argv)
    overrides = json.loads(args.spec)
    rows = args.rows
    if args.smoke:
        overrides = {"model": "tiny", "micro_batch": 2, "seq_len": 32, "steps": 2, "warmup": 1, **overrides}
        rows = [r for r in rows if not r.startswith("ds")] if args.rows == DEFAULT_ROWS else rows
    spec = GpuSpec(**overrides)
    nproc = args.nproc
    if nproc is None:
        import torch

        nproc = max(torch.cuda.device_count(), 1)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for row in rows:
        r = run_row(row, spec, nproc, args.out_dir, args.timeout_s)
        print(f"[gpu bench] {row}: {r.get('status')} "
              f"{r.get('tokens_per_s', 0):.0f} tokens/s {r.get('message', '')[:200]}", flush=True)
        results.append(r)
    m = next((r for r in results if r.get("gpu")), {})
    text = render(results, peak_tflops(m.get("gpu"), args.peak_tflops))
    args.results.write_text(text)
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=1))
    print(text)
    return 0 if all(r.get("status") in ("ok", "oom") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
