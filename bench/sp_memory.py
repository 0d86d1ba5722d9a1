"""Sequence parallelism (ALST) memory and step time against sequence length (issue 41 item 4).

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=... python bench/sp_memory.py [--lengths 1024 2048 ...] [--sps 1 2 4]
    python bench/sp_memory.py --render-only            # re-render bench/sp_memory.md from runs/sp_memory/*.json

A tiny Llama built from its config (`transformers.LlamaConfig`, sdpa attention, nothing downloaded)
trained the ALST way (`UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1)`, then
`initialize(model=..., config=..., mpu=mpu)`, each rank feeding its slice of the sequence with global
`position_ids` and pre-shifted labels) at ZeRO-3, fp32, micro-batch 1, AdamW, clipping 1.0, by:

- `zs`: zeroshard (`zeroshard.sequence.alst`); loss `token_weighted_loss(local mean, count, sp group)`;
- `ds`: DeepSpeed 0.19.x (`deepspeed.runtime.sequence_parallel.ulysses_sp`); the loss as Transformers'
  `deepspeed_sp_compute_loss` computes it (local sum share + detach, times SP at ZeRO-3 before 0.20.2);
- `zs_tiled`: `zs` with every MLP run through `TiledMLP` and the head + cross-entropy through
  `TiledFusedLogitsLoss`, both in tiles of `--tile` tokens.

`zs` and `ds` take the logits from the model's output (`model(...).logits`, the whole `[seq/sp, vocab]`
tensor) and compute the cross-entropy from them, as a script using the HF forward does. At SP 1 there
is no `register` (a plain engine in one process).

Every configuration (engine x SP x length) is one fresh `torchrun` job of SP processes, so each peak is
that configuration's own. Per rank: RSS right before the first step (`/proc/self/status` VmRSS, after
`gc.collect()`), then the peak RSS high-water mark is reset (`/proc/self/clear_refs` 5) and after the
steps `ru_maxrss` is read: **step peak** = ru_maxrss - RSS before, the steps' own peak (activations,
gradients, optimizer state created on the first step, allocator slack); **abs peak** = the largest
ru_maxrss of the process's life (start-up included). Step time: each step's slowest rank, median over
the timed steps after `--warmup` untimed ones (fewer timed steps when they would take longer than
`--time-cap` s). Per engine x SP, lengths run in increasing order; a length whose step is predicted
(from the last doubling's growth) to exceed `--max-step` s is skipped with the larger ones.
Raw records: runs/sp_memory/<engine>-sp<N>-<L>.json; the tables go to bench/sp_memory.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "sp_memory"
MD = ROOT / "bench" / "sp_memory.md"
ENGINES = ("zs", "ds", "zs_tiled")
LABELS = {"zs": "zeroshard", "ds": "DeepSpeed 0.19", "zs_tiled": "zeroshard + TiledMLP + TiledFusedLogitsLoss"}
SHAPE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}
DS_CONFIG: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                             "zero_optimization": {"stage": 3}, "steps_per_print": 10**6,
                             "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
                             "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0}
MIB = 2**20


def _rss_kib() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _maxrss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _cpu_s() -> float:
    """This process's CPU time (user + system, all threads) so far."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _reset_peak() -> bool:
    """Reset this process's RSS high-water mark (Linux >= 4.0); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _maxrss_kib() <= _rss_kib() + 1024


def _llama(seq: int) -> Any:
    import transformers

    cfg = transformers.LlamaConfig(**SHAPE, max_position_embeddings=seq, attn_implementation="sdpa",
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float()


def _tile(model: Any, tile: int) -> None:
    """The ALST tutorial's MLP patch on this model's instances: each MLP in tiles of `tile` tokens."""
    from zeroshard.sequence.tiled import TiledMLP

    for layer in model.model.layers:
        def tiled(x: torch.Tensor, mlp: Any = layer.mlp) -> torch.Tensor:
            return TiledMLP.apply(lambda m, t: m.down_proj(m.act_fn(m.gate_proj(t)) * m.up_proj(t)), mlp, x,
                                  max(1, math.ceil(x.shape[1] / tile)), None)
        layer.mlp.forward = tiled


class TiledLoss(torch.nn.Module):
    """Model + loss in one forward: (mean token loss, counted tokens) of this rank's slice, the head and
    cross-entropy through `TiledFusedLogitsLoss` (no `[seq, vocab]` logits tensor)."""

    def __init__(self, model: Any, tile: int) -> None:
        super().__init__()
        self.model, self.tile = model, tile
        _tile(model, tile)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor) -> tuple:
        from zeroshard.sequence.tiled import TiledFusedLogitsLoss

        hidden = self.model.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
        count = (labels != -100).sum()

        def fn(head: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(head(x), y, ignore_index=-100, reduction="sum")
        shards = max(1, math.ceil(labels.numel() / self.tile))
        total = TiledFusedLogitsLoss.apply(fn, self.model.lm_head, hidden, labels, None, shards, None, "sum")
        return total / count.clamp(min=1), count


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    engine_name, seq = args.engine, args.seq
    if engine_name == "ds":
        import deepspeed
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF as DSUlysses

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        import zeroshard
        from zeroshard.sequence import token_weighted_loss
        from zeroshard.sequence.alst import UlyssesSPAttentionHF as ZSUlysses

        zeroshard.init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    sp = dist.get_world_size() if dist.is_initialized() else 1
    hf = _llama(seq)
    params = sum(p.numel() for p in hf.parameters())
    ulysses = DSUlysses if engine_name == "ds" else ZSUlysses
    mpu = ulysses.register_with_transformers(hf, "sdpa", sp, micro_batch_size=1) if sp > 1 else None
    group = mpu.get_sequence_parallel_group() if mpu is not None else None
    if engine_name == "ds":
        cfg = json.loads(json.dumps(DS_CONFIG))
        engine, *_ = deepspeed.initialize(model=hf, config=cfg, mpu=mpu)
    else:
        cfg = json.loads(json.dumps(DS_CONFIG))
        model = TiledLoss(hf, args.tile) if engine_name == "zs_tiled" else hf
        engine, *_ = zeroshard.initialize(model=model, config=cfg, mpu=mpu)

    local = seq // sp
    part = slice(rank * local, (rank + 1) * local)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)  # the whole sample, the same on every rank and engine
        ids = torch.randint(0, SHAPE["vocab_size"], (1, seq), generator=g)
        shift = F.pad(ids, (0, 1), value=-100)[:, 1:]
        return ids[:, part], torch.arange(seq)[None, part], shift[:, part]

    def step(i: int) -> float:
        ids, pos, shift = batch(i)
        count = (shift != -100).sum()
        if engine_name == "zs_tiled":
            mean, count = engine(ids, pos, shift)
        else:
            logits = engine(input_ids=ids, position_ids=pos).logits
            mean = F.cross_entropy(logits.flatten(0, 1).float(), shift.flatten(), ignore_index=-100)
        if engine_name == "ds":  # transformers.integrations.deepspeed.deepspeed_sp_compute_loss
            local_sum = torch.where(count > 0, mean.float(), 0.0) * count
            if group is not None:
                totals = torch.stack((local_sum.detach(), count.float()))
                dist.all_reduce(totals, group=group)
                local_sum = local_sum * sp  # ZeRO-3 averages SP gradients before DeepSpeed 0.20.2
                loss = (local_sum + (totals[0] - local_sum.detach())) / totals[1].clamp(min=1)
            else:
                loss = local_sum / count.clamp(min=1)
        else:
            loss = token_weighted_loss(mean, count, group) if group is not None else mean
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    gc.collect()
    if dist.is_initialized():
        dist.barrier()
    rss_before, start_peak = _rss_kib(), _maxrss_kib()
    reset = _reset_peak()
    times, cpus, losses, timed = [], [], [], 0.0
    for i in range(args.warmup + args.steps):
        if i > args.warmup and timed + times[-1] > args.time_cap:
            break  # at least one timed step
        start, cpu = time.perf_counter(), _cpu_s()
        losses.append(step(i))
        times.append(time.perf_counter() - start)
        cpus.append(_cpu_s() - cpu)
        if i >= args.warmup:
            timed += times[-1]
    after = _maxrss_kib()
    mine = {"rank": rank, "rss_before_kib": rss_before, "start_peak_kib": start_peak, "maxrss_after_kib": after,
            "peak_reset": reset, "times": times, "cpu_s": cpus, "losses": losses}
    everyone = [mine]
    if dist.is_initialized() and sp > 1:
        everyone = [None] * sp
        dist.all_gather_object(everyone, mine)
    if rank == 0:
        step_times = [max(r["times"][i] for r in everyone) for i in range(min(len(r["times"]) for r in everyone))]
        rec = {"engine": args.engine, "sp": sp, "seq": seq, "params": params, "tile": args.tile if
               engine_name == "zs_tiled" else None, "warmup": args.warmup, "timed_steps": len(step_times) - args.warmup,
               "step_times_s": step_times, "median_step_s": statistics.median(step_times[args.warmup:]),
               "median_cpu_s": statistics.median(sum(r["cpu_s"][i] for r in everyone)
                                                 for i in range(args.warmup, len(step_times))),
               "losses": losses, "ranks": everyone,
               "step_peak_mib": [(r["maxrss_after_kib"] - r["rss_before_kib"]) / 1024 for r in everyone],
               "abs_peak_mib": [max(r["start_peak_kib"], r["maxrss_after_kib"]) / 1024 for r in everyone],
               "rss_before_mib": [r["rss_before_kib"] / 1024 for r in everyone]}
        Path(args.out).write_text(json.dumps(rec, indent=1))
    if engine_name != "ds":
        from zeroshard.sequence.alst import restore_transformers_attention
        restore_transformers_attention()


def _machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {"host": platform.node(), "cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__, "loadavg": [round(x, 2) for x in load],
            "time": datetime.now().isoformat(timespec="seconds")}


def _run_one(args: argparse.Namespace, engine: str, sp: int, seq: int) -> dict[str, Any]:
    out = OUT / f"{engine}-sp{sp}-{seq}.json"
    out.unlink(missing_ok=True)
    cmd = [args.python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={sp}", __file__,
           "--worker", "--engine", engine, "--seq", str(seq), "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--tile", str(args.tile), "--time-cap", str(args.time_cap), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    before = _machine()
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        error = None if proc.returncode == 0 and out.exists() else \
            f"exit {proc.returncode}: " + " | ".join(_errors(proc.stdout + proc.stderr))
    except subprocess.TimeoutExpired:
        error = f"timed out after {args.timeout} s"
    wall = time.perf_counter() - start
    rec = json.loads(out.read_text()) if error is None else {"engine": engine, "sp": sp, "seq": seq, "error": error}
    rec.update({"machine": before, "loadavg_after": [round(x, 2) for x in os.getloadavg()], "job_wall_s": wall})
    out.write_text(json.dumps(rec, indent=1))
    return rec


def _errors(text: str) -> list[str]:
    """The last distinct exception lines of a failed job's output."""
    lines = [ln.strip() for ln in text.splitlines() if re.match(r"\s*\w*(Error|Exception)\b|^\s*\w+\.\w*Error", ln)]
    seen: list[str] = []
    for ln in reversed(lines):
        if ln not in seen:
            seen.append(ln[:300])
    return seen[:2] or [text.strip().splitlines()[-1][:300] if text.strip() else "no output"]


def _drive(args: argparse.Namespace) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    stopped: dict[tuple[str, int], str] = {}
    last: dict[tuple[str, int], tuple[int, float]] = {}
    start = time.perf_counter()
    for sp in args.sps:
        for seq in args.lengths:
            for engine in args.engines:
                key = (engine, sp)
                out = OUT / f"{engine}-sp{sp}-{seq}.json"
                if key in stopped:
                    out.write_text(json.dumps({"engine": engine, "sp": sp, "seq": seq, "skipped": stopped[key]}))
                    continue
                rec = _run_one(args, engine, sp, seq)
                if "error" in rec:
                    print(f"{engine} sp{sp} {seq}: FAILED {rec['error']}", flush=True)
                    continue
                t = rec["median_step_s"]
                growth = min(4.0, max(2.0, t / last[key][1])) if key in last else 4.0
                last[key] = (seq, t)
                if t * growth > args.max_step:
                    stopped[key] = f"not run: step at {seq} took {t:.1f} s, x{growth:.1f} > {args.max_step:.0f} s"
                print(f"{engine} sp{sp} {seq}: step peak {max(rec['step_peak_mib']):.1f} MiB, abs "
                      f"{max(rec['abs_peak_mib']):.0f} MiB, {t:.2f} s/step ({rec['timed_steps']} timed), job "
                      f"{rec['job_wall_s']:.0f} s, elapsed {time.perf_counter() - start:.0f} s", flush=True)
    (OUT / "meta.json").write_text(json.dumps({"wall_s": time.perf_counter() - start, "args": {
        k: v for k, v in vars(args).items() if k not in ("worker", "out", "local_rank")}, "finished": _machine()}))
    render(args)


def _fmt(x: float, nd: int = 1) -> str:
    return f"{x:.{nd}f}"


def render(args: argparse.Namespace) -> None:
    recs = [json.loads(p.read_text()) for p in sorted(OUT.glob("*-sp*-*.json"))]
    meta = json.loads((OUT / "meta.json").read_text()) if (OUT / "meta.json").exists() else {}
    recs.sort(key=lambda r: (ENGINES.index(r["engine"]) if r["engine"] in ENGINES else 9, r["sp"], r["seq"]))
    ok = [r for r in recs if "median_step_s" in r]
    machines = sorted({(r["machine"]["host"], r["machine"]["cpus"], r["machine"]["torch"]) for r in ok})
    loads = [x for r in ok for x in (r["machine"]["loadavg"][0], r["loadavg_after"][0])]
    times = sorted(r["machine"]["time"] for r in ok)
    lines = ["# Sequence parallelism (ALST): memory and step time against sequence length (issue 41 item 4)", "",
             "Generated by `bench/sp_memory.py` (method in its docstring and in bench/README.md); raw records in "
             "`runs/sp_memory/`.", "",
             f"Model: `LlamaForCausalLM` from `LlamaConfig({', '.join(f'{k}={v}' for k, v in SHAPE.items())}, "
             f"attn_implementation=\"sdpa\")`, {ok[0]['params'] if ok else '?'} parameters, fp32, ZeRO-3, "
             "micro-batch 1, AdamW (`torch_adam`), clipping 1.0, gloo. "
             f"Tiled row: tiles of {meta.get('args', {}).get('tile', args.tile)} tokens for the MLPs and the "
             "logits-loss.", ""]
    if ok:
        lines += [f"Machine: {', '.join(f'{h} ({c} CPU cores, torch {t})' for h, c, t in machines)}; measured "
                  f"{times[0]} to {times[-1]}, 1-minute load average {min(loads):.1f}-{max(loads):.1f} at the jobs' "
                  "starts and ends (other jobs share the box), so step times are noisy; SP 4 runs 4 processes on "
                  "2 cores (oversubscribed: its step times are not a speed-up measurement, its memory is fine). "
                  + (f"Whole bench: {meta['wall_s'] / 60:.1f} min." if "wall_s" in meta else ""), ""]
    lines += ["## Per configuration", "",
              "Step peak: the training steps' own peak RSS above the RSS right before the first step (max over "
              "ranks, then each rank). Abs peak: the process's peak RSS (max over ranks). Step: median of the "
              "slowest rank's step time over the timed steps (count in brackets) after one warm-up. CPU: user + "
              "system time per step summed over the ranks (median over the timed steps), less sensitive to the "
              "other jobs than wall time. Loss diff: the largest difference of a step's loss from zeroshard's at "
              "SP 1 on the same length (same initial weights and samples).", "",
              "| engine | SP | tokens | tokens / rank | step peak MiB (max rank) | step peak MiB per rank "
              "| abs peak MiB | RSS before step MiB | step s | CPU s / step | loss diff |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    ref = {r["seq"]: r["losses"] for r in ok if r["engine"] == "zs" and r["sp"] == 1}
    for r in recs:
        head = f"| {LABELS.get(r['engine'], r['engine'])} | {r['sp']} | {r['seq']} | {r['seq'] // r['sp']} "
        if "error" in r or "skipped" in r:
            lines.append(head + f"| {'FAILED: ' + r['error'] if 'error' in r else r['skipped']} | | | | | | |")
            continue
        diff = max((abs(a - b) for a, b in zip(r["losses"], ref.get(r["seq"], []))), default=None)
        flag = "" if all(x["peak_reset"] for x in r["ranks"]) else " (peak not reset: start-up peak)"
        per_rank = " / ".join(_fmt(x) for x in r["step_peak_mib"])
        lines.append(head + f"| {_fmt(max(r['step_peak_mib']))}{flag} | {per_rank} "
                     f"| {max(r['abs_peak_mib']):.0f} | {max(r['rss_before_mib']):.0f} "
                     f"| {r['median_step_s']:.2f} ({r['timed_steps']}) | {r.get('median_cpu_s', float('nan')):.2f} "
                     f"| {'-' if diff is None else f'{diff:.1e}'} |")
    for budget in args.budgets:
        lines += ["", f"## Longest tested sequence within {budget:g} MiB of step peak per rank", "",
                  "The largest tested length whose step peak (max over ranks) stays under the budget; \"> L\" when "
                  "even the longest length run fits, \"-\" when none does.", "",
                  "| engine | " + " | ".join(f"SP {sp}" for sp in args.sps) + " |",
                  "|---|" + "---|" * len(args.sps)]
        for engine in args.engines:
            cells = []
            for sp in args.sps:
                mine = [r for r in ok if r["engine"] == engine and r["sp"] == sp]
                fits = [r["seq"] for r in mine if max(r["step_peak_mib"]) < budget]
                longest = max((r["seq"] for r in mine), default=0)
                if not mine:
                    cells.append("not run")
                elif not fits:
                    cells.append("-")
                else:
                    best = max(fits)
                    cells.append(f"> {best}" if best == longest and all(max(r["step_peak_mib"]) < budget
                                                                       for r in mine) else f"{best}")
            lines.append(f"| {LABELS[engine]} | " + " | ".join(cells) + " |")
    MD.write_text("\n".join(lines) + "\n" + _notes())
    print("\n".join(lines))


def _notes() -> str:
    """Hand-written findings kept below the generated tables (the part after the marker in the old file)."""
    marker = "<!-- notes -->"
    old = MD.read_text() if MD.exists() else ""
    return "\n" + marker + old.split(marker, 1)[1] if marker in old else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--sps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--tile", type=int, default=1024, help="tokens per tile for the tiled row")
    parser.add_argument("--budgets", type=float, nargs="+", default=[100.0, 300.0], help="MiB of step peak per rank")
    parser.add_argument("--max-step", type=float, default=60.0, help="skip lengths whose step would exceed this (s)")
    parser.add_argument("--time-cap", type=float, default=30.0, help="stop timing a configuration after this (s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-job limit (s)")
    parser.add_argument("--python", default=sys.executable, help="interpreter with zeroshard and deepspeed")
    parser.add_argument("--render-only", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
    elif args.render_only:
        render(args)
    else:
        _drive(args)


if __name__ == "__main__":
    main()
