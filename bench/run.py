"""zeroshard vs DeepSpeed vs PyTorch (DDP, ZeroRedundancyOptimizer, FSDP2): one command, one table.

    python bench/run.py                 # default: all engines, 3 alternating rounds (~12-15 min)
    python bench/run.py --quick         # smoke run: 1 round, few steps (~3 min)
    python bench/run.py --engines zs2 ds2 ddp --rounds 5

Every engine trains the same ~25M-parameter GPT (same seed, same corpus batches per rank and
step) at world size 2 under torchrun (gloo, OMP_NUM_THREADS=1 per rank), each run a fresh
process pair. Rounds alternate (round 1: every engine in order, round 2: again, ...) so machine
noise hits every engine alike; a row's figure is the median over rounds of the median step time.
Writes the engine section of bench/results.md (the cpu_adam section, written by
bench/cpu_adam.py, is kept) and the raw per-rank data under bench/out/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from engines import DEFAULT_ENGINES, ENGINES, EngineSpec  # noqa: E402  bench/engines loads after the sys.path insert
from engines.common import RunSpec  # noqa: E402  bench/engines loads after the sys.path insert

WORLD_SIZE = 2
MIB = 2**20
SECTION = "engines"


# -- running -------------------------------------------------------------------------------


def _cpu_snapshot() -> tuple[int, int]:
    """(idle, total) jiffies over all cores since boot, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields)


def cpu_busy(interval_s: float = 0.5) -> float:
    """Fraction of all cores busy over `interval_s`, 0.0 where /proc/stat is unreadable."""
    try:
        i0, t0 = _cpu_snapshot()
        time.sleep(interval_s)
        i1, t1 = _cpu_snapshot()
    except (OSError, ValueError, IndexError):
        return 0.0
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


class OthersCpu:
    """Share of all cores used by processes other than our (waited-for) children meanwhile::

        meter = OthersCpu(); subprocess.run(...); share = meter.share()
    """

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        self._snap0 = _cpu_snapshot()

    def share(self) -> float:
        wall = time.perf_counter() - self._t0
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        snap1 = _cpu_snapshot()
        ours_s = (ru1.ru_utime + ru1.ru_stime) - (self._ru0.ru_utime + self._ru0.ru_stime)
        busy_s = ((snap1[1] - snap1[0]) - (self._snap0[1] - self._snap0[0])) / os.sysconf("SC_CLK_TCK")
        return max(0.0, busy_s - ours_s) / (max(wall, 1e-9) * (os.cpu_count() or 1))


def wait_idle(max_wait_s: float, busy_limit: float = 0.25) -> float:
    """Wait (up to `max_wait_s`) until other processes leave the cores idle; return the last
    busy fraction seen. Our own runs are sequential, so anything busy here is someone else."""
    deadline = time.monotonic() + max_wait_s
    busy = cpu_busy()
    while busy > busy_limit and time.monotonic() < deadline:
        busy = cpu_busy(2.0)
    return busy


def run_once(engine: str, spec: RunSpec, steps: int, warmup: int, out_dir: Path,
             timeout_s: float, nice: int = 0) -> dict[str, Any]:
    """One fresh torchrun of one engine; returns {"status", "ranks": [...], "wall_s", ...}."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={WORLD_SIZE}", str(BENCH / "runner.py"), "--engine", engine,
           "--steps", str(steps), "--warmup", str(warmup), "--spec", json.dumps(spec.to_dict()),
           "--out-dir", str(out_dir)]
    t0 = time.perf_counter()
    meter = OthersCpu()
    log = out_dir / "log.txt"
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                timeout=timeout_s, preexec_fn=_set_nice(nice)).returncode
        except subprocess.TimeoutExpired:
            rc = None
    wall = time.perf_counter() - t0
    others = meter.share()
    ranks = []
    for r in range(WORLD_SIZE):
        p = out_dir / f"rank{r}.json"
        if p.exists():
            ranks.append(json.loads(p.read_text()))
    statuses = {r["status"] for r in ranks}
    if rc is None:
        status, message = "error", f"timed out after {timeout_s:.0f} s"
    elif len(ranks) == WORLD_SIZE and statuses == {"ok"}:
        status, message = "ok", ""
    elif "unsupported" in statuses:
        status = "unsupported"
        message = next(r["message"] for r in ranks if r["status"] == "unsupported")
    else:
        status = "error"
        failed = [r for r in ranks if r["status"] == "error"]
        message = failed[0]["message"] if failed else f"exit code {rc}, see {log}"
    return {"status": status, "message": message, "ranks": ranks, "wall_s": wall, "log": str(log),
            "others_cpu": others}


def _set_nice(nice: int):  # a preexec_fn or None
    if nice == 0:
        return None
    return lambda: os.setpriority(os.PRIO_PROCESS, 0, nice)  # inherited by torchrun's ranks


def round_figures(run: dict[str, Any], spec: RunSpec) -> dict[str, Any]:
    """Per-round numbers of a successful run: the slowest rank's time for each step."""
    ranks = sorted(run["ranks"], key=lambda r: r["rank"])
    per_step = [max(ts) for ts in zip(*(r["step_s"] for r in ranks))]
    median_s = statistics.median(per_step)
    return {
        "step_s": median_s,
        "samples_per_s": spec.micro_batch * WORLD_SIZE / median_s,
        "cpu_s": sum(r["cpu_s_per_step"] for r in ranks),
        "sys_s": sum(r["sys_s_per_step"] for r in ranks),
        "faults": sum(r["minor_faults"] for r in ranks) / len(per_step),
        "peak_rss": [r["peak_rss_bytes"] for r in ranks],
        "rss_before_build": [r["rss_before_build_bytes"] for r in ranks],
        "census": [r["census_bytes"] for r in ranks],
        "reported": [r["reported_state_bytes"] for r in ranks],
        "final_loss": statistics.fmean(r["losses"][-1] for r in ranks),
        "init_s": max(r["init_s"] for r in ranks),
        "optimizer": ranks[0]["optimizer"],
        "threads": sorted({r["num_threads"] for r in ranks} | {r["num_threads_after"] for r in ranks}),
    }


def preflight(engines: list[EngineSpec], spec: RunSpec) -> dict[str, str]:
    """Reasons a row cannot run at all, found without starting it."""
    skip = {}
    if spec.precision != "fp32":
        for e in engines:
            if e.family == "torch":
                skip[e.name] = f"the torch baselines run fp32 only (asked for {spec.precision})"
    if importlib.util.find_spec("deepspeed") is None:
        for e in engines:
            if e.family == "deepspeed":
                skip[e.name] = "DeepSpeed is not installed (pip install -e '.[bench]')"
    return skip


def measure(engine: str, spec: RunSpec, args: argparse.Namespace, out_dir: Path, what: str) -> dict[str, Any]:
    """One run of `engine`; repeated (up to --retries times) while other processes took more
    than --max-others of the cores during it, keeping the quietest attempt."""
    best = None
    for attempt in range(1 + args.retries):
        busy = wait_idle(args.wait_idle) if args.wait_idle > 0 else 0.0
        if attempt == 0:
            print(f"[bench] {what}: {engine:12s} ", end="", flush=True)
        run = run_once(engine, spec, args.steps, args.warmup,
                       out_dir.with_name(f"{out_dir.name}-a{attempt + 1}"), args.timeout, args.nice)
        run["busy_before"] = busy
        if best is None or (run["status"] == "ok" and run["others_cpu"] < best["others_cpu"]):
            best = run
        if run["status"] != "ok" or run["others_cpu"] <= args.max_others or attempt == args.retries:
            break
        print(f"(others used {run['others_cpu']:.0%} of the cores: again) ", end="", flush=True)
    best["attempts"] = attempt + 1
    return best


def run_all(args: argparse.Namespace, spec: RunSpec) -> dict[str, Any]:
    engines = [ENGINES[n] for n in args.engines]
    results: dict[str, dict[str, Any]] = {
        e.name: {"status": "pending", "message": "", "rounds": [], "wall_s": []} for e in engines}
    for name, why in preflight(engines, spec).items():
        results[name].update(status="skipped", message=why)
    out_root = BENCH / "out" / "runs"
    if out_root.exists():
        shutil.rmtree(out_root)
    for rnd in range(1, args.rounds + 1):
        for e in engines:
            res = results[e.name]
            if res["status"] in ("unsupported", "skipped"):
                continue  # decided in an earlier round: do not pay the process start again
            run = measure(e.name, spec, args, out_root / f"r{rnd}-{e.name}", f"round {rnd}/{args.rounds}")
            busy = run["busy_before"]
            res["wall_s"].append(run["wall_s"])
            res.setdefault("busy_before", []).append(busy)
            res.setdefault("others_cpu", []).append(run["others_cpu"])
            if run["status"] != "ok":
                # An error is retried next round (zeroshard may be mid-edit, a peer may have
                # hogged memory); a row with any good round is reported from its good rounds.
                if not res["rounds"]:
                    res.update(status=run["status"], message=run["message"], log=run["log"])
                res.setdefault("failed_rounds", []).append(f"round {rnd}: {run['message']}")
                print(f"{run['status']}: {run['message'][:150]} ({run['wall_s']:.0f} s)", flush=True)
                continue
            fig = round_figures(run, spec)
            fig["others_cpu"] = run["others_cpu"]
            res["rounds"].append(fig)
            res["status"] = "ok"
            print(f"{fig['samples_per_s']:6.2f} samples/s, step {fig['step_s']:.3f} s, peak RSS "
                  f"{'/'.join(f'{b / MIB:.0f}' for b in fig['peak_rss'])} MiB, "
                  f"loss {fig['final_loss']:.5f} ({run['wall_s']:.0f} s, others used "
                  f"{run['others_cpu']:.0%} of the cores)", flush=True)
    return results


# -- summarising ---------------------------------------------------------------------------


def summarise(results: dict[str, Any], max_others: float) -> dict[str, dict[str, Any]]:
    """Median over rounds for each successful row.

    Speed (samples/s, step time) is the median over the *quiet* rounds, those during which
    other processes used at most `max_others` of the cores, when there is at least one; a row
    with none is flagged `noisy`. Everything else is the median over all rounds.
    """
    rows = {}
    for name, res in results.items():
        rounds = res["rounds"]
        row: dict[str, Any] = {"status": res["status"], "message": res["message"],
                               "wall_s": sum(res["wall_s"]), "failed_rounds": res.get("failed_rounds", [])}
        if res["status"] == "ok" and rounds:
            med = statistics.median
            for i, r in enumerate(rounds):  # results.json files written before others_cpu moved
                if "others_cpu" not in r and len(res.get("others_cpu", [])) == len(rounds):
                    r["others_cpu"] = res["others_cpu"][i]
            quiet = [r for r in rounds if r.get("others_cpu", 0.0) <= max_others]
            row.update(
                noisy=not quiet,
                others_cpu=[r.get("others_cpu", 0.0) for r in rounds],
                samples_per_s=med(r["samples_per_s"] for r in quiet or rounds),
                samples_per_s_all=[r["samples_per_s"] for r in rounds],
                step_s=med(r["step_s"] for r in quiet or rounds),
                cpu_s=med(r["cpu_s"] for r in rounds),
                sys_s=med(r["sys_s"] for r in rounds),
                faults=med(r["faults"] for r in rounds),
                peak_rss=[med(r["peak_rss"][k] for r in rounds) for k in range(WORLD_SIZE)],
                rss_before_build=[med(r["rss_before_build"][k] for r in rounds) for k in range(WORLD_SIZE)],
                census=max(max(r["census"]) for r in rounds),
                reported=rounds[-1]["reported"][0],
                final_loss=rounds[-1]["final_loss"],
                init_s=med(r["init_s"] for r in rounds),
                optimizer=rounds[-1]["optimizer"],
                threads=rounds[-1]["threads"],
            )
        rows[name] = row
    return rows


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def _mib(b: float | None) -> str:
    return "–" if b is None else f"{b / MIB:.0f}"


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).replace("|", "\\|")


def _counterpart(e: EngineSpec) -> str | None:
    """The DeepSpeed row a zeroshard row is compared with (and vice versa)."""
    if e.family == "zeroshard":
        return "ds" + e.name[2:].removesuffix("_check_off")
    if e.family == "deepspeed":
        return "zs" + e.name[2:]
    return None


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}"


def versions() -> str:
    import torch

    parts = [f"Python {platform.python_version()}", f"torch {torch.__version__}"]
    try:
        from importlib.metadata import version

        parts.append(f"DeepSpeed {version('deepspeed')}")
    except Exception:
        parts.append("DeepSpeed not installed")
    try:
        from importlib.metadata import version

        parts.append(f"zeroshard {version('zeroshard')}")
    except Exception:
        pass
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "zeroshard"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        parts.append(f"zeroshard tree {sha}{' + uncommitted changes' if dirty else ''}")
    except OSError:
        pass
    return ", ".join(parts)


def render(rows: dict[str, dict[str, Any]], args: argparse.Namespace, spec: RunSpec,
           total_s: float, when: str | None = None) -> str:
    from engines.common import build_model

    n_params = sum(p.numel() for p in build_model(spec).parameters())
    ddp = rows.get("ddp", {}).get("samples_per_s")
    L = []
    L.append(f"Measured {when or dt.datetime.now().strftime('%Y-%m-%d %H:%M')} by `python bench/run.py"
             f"{' --quick' if args.quick else ''}"
             f"{' ' + ' '.join(args.extra_argv) if args.extra_argv else ''}` in {total_s / 60:.1f} min.")
    L.append("")
    L.append(f"- Machine: {getattr(args, 'machine', None) or machine()}.")
    L.append(f"- Software: {getattr(args, 'versions', None) or versions()}.")
    L.append(f"- Model: GPT preset `{spec.model}` ({n_params / 1e6:.1f}M parameters, tied embedding), "
             f"{spec.precision}, micro batch {spec.micro_batch} x {spec.seq_len} tokens per rank, "
             f"world size {WORLD_SIZE} (gloo, OMP_NUM_THREADS=1 per rank), corpus batches.")
    L.append(f"- Optimizer: AdamW lr {spec.lr:g}, betas {spec.betas}, eps {spec.eps:g}, weight decay "
             f"{spec.weight_decay:g}; gradient clipping {spec.grad_clip:g}; reduce/allgather bucket "
             f"{spec.bucket_numel:.0e} elements (DDP bucket_cap_mb {spec.bucket_numel * 4 / MIB:.1f}).")
    L.append(f"- Timing: {args.warmup} warm-up + {args.steps} timed steps per run, {args.rounds} "
             f"alternating round(s); samples/s = {spec.micro_batch * WORLD_SIZE} / median step time "
             f"(slowest rank per step), then the median over the quiet rounds (other processes used "
             f"<= {args.max_others:.0%} of the cores; all rounds, marked noisy, where none was quiet)"
             f"{f'; runs at nice {args.nice}' if args.nice else ''}"
             + (f"; a run during which other processes used > {args.max_others:.0%} of the cores was "
                f"repeated up to {args.retries} time(s), keeping the quietest." if args.retries else "."))
    L.append("")
    L.append("| engine | samples/s | vs DeepSpeed same stage | vs DDP | CPU s / step (vs DeepSpeed) "
             "| peak RSS rank 0 / 1 (MiB) | RSS vs DeepSpeed | model states (MiB/rank) "
             "| loss after last step | optimizer |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, row in rows.items():
        e = ENGINES[name]
        if row["status"] != "ok":
            why = {"unsupported": "not supported yet", "skipped": "skipped", "error": "error",
                   "pending": "not run"}[row["status"]]
            msg = _one_line(row["message"])[:220]
            L.append(f"| {e.label} | {why} | | | | | | | | {msg} |")
            continue
        other = rows.get(_counterpart(e) or "", {})
        vs_ds = _ratio(row["samples_per_s"], other.get("samples_per_s")) if e.family == "zeroshard" else ""
        rss_mean = statistics.fmean(row["peak_rss"])
        rss_vs = _ratio(rss_mean, statistics.fmean(other["peak_rss"])) \
            if e.family == "zeroshard" and other.get("status") == "ok" else ""
        census = _mib(row["census"])
        if row.get("reported") is not None:
            census += f" (reports {_mib(row['reported'])})"
        cpu = f"{row['cpu_s']:.2f}"
        if e.family == "zeroshard" and other.get("status") == "ok":
            cpu += f" ({_ratio(row['cpu_s'], other['cpu_s'])})"
        flag = " (noisy)" if row["noisy"] else ""
        L.append(f"| {e.label} | {row['samples_per_s']:.2f}{flag} | {vs_ds} | {_ratio(row['samples_per_s'], ddp)} "
                 f"| {cpu} "
                 f"| {' / '.join(_mib(b) for b in row['peak_rss'])} | {rss_vs} | {census} "
                 f"| {row['final_loss']:.5f} | {row['optimizer']} |")
    L.append("")
    L.append("Per-round samples/s; median step time; CPU time per step summed over both ranks and all "
             "their threads (user + system, system in brackets), which other processes barely "
             "disturb, so it is the steadier measure of the work an engine does (2 cores: at most "
             "2 CPU s per wall second); minor page faults per step (both ranks); set-up time "
             "(slowest rank's build + initialize); RSS before the model was built:")
    L.append("")
    L.append("| engine | samples/s per round | step (s) | CPU s / step (sys) | page faults / step "
             "| set-up (s) | RSS before build (MiB) | run wall (s) | others' CPU per round |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for name, row in rows.items():
        if row["status"] != "ok":
            continue
        L.append(f"| {ENGINES[name].label} | {', '.join(f'{x:.2f}' for x in row['samples_per_s_all'])} "
                 f"| {row['step_s']:.3f} | {row['cpu_s']:.2f} ({row['sys_s']:.2f}) | {row['faults']:.0f} "
                 f"| {row['init_s']:.1f} "
                 f"| {' / '.join(_mib(b) for b in row['rss_before_build'])} | {row['wall_s']:.0f} "
                 f"| {', '.join(f'{x:.0%}' for x in row['others_cpu'])} |")
    failed = [(name, f) for name, row in rows.items() if row["status"] == "ok" for f in row["failed_rounds"]]
    if failed:
        L.append("")
        L.append("Rounds that failed (the row is reported from its other rounds):")
        L.append("")
        L.extend(f"- {ENGINES[name].label}, {_one_line(f)[:300]}" for name, f in failed)
    others = [x for row in rows.values() for x in row.get("others_cpu", [])]
    if others:
        L.append("")
        L.append(f"Others' CPU: the share of the {os.cpu_count()} cores used by processes other than "
                 f"the benchmark during a run (max {max(others):.0%}, median "
                 f"{statistics.median(others):.0%} over {len(others)} runs); rows measured while "
                 "it was high are slower than the machine allows"
                 + (f". Each run first waited up to {args.wait_idle:.0f} s for the cores to be idle."
                    if args.wait_idle else "."))
    return "\n".join(L)


def write_section(path: Path, section: str, body: str, title: str) -> None:
    """Replace the text between <!-- section:begin --> and <!-- section:end --> markers."""
    begin, end = f"<!-- {section}:begin -->", f"<!-- {section}:end -->"
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + f"\n\n## {title}\n\n{block}\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 8; quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; quick 1)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; quick 1)")
    p.add_argument("--engines", nargs="+", default=list(DEFAULT_ENGINES), choices=list(ENGINES), metavar="ENGINE",
                   help=f"rows to run, in order (default: {' '.join(DEFAULT_ENGINES)}; also: "
                        f"{' '.join(e for e in ENGINES if e not in DEFAULT_ENGINES)})")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round, 1 warm-up + 3 timed steps")
    p.add_argument("--micro-batch", type=int, default=RunSpec.micro_batch)
    p.add_argument("--seq-len", type=int, default=RunSpec.seq_len)
    p.add_argument("--bucket-numel", type=float, default=RunSpec.bucket_numel)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--wait-idle", type=float, default=None,
                   help="before each run, wait up to this many seconds for other processes to leave "
                        "the cores idle (default 20; quick 0: do not wait)")
    p.add_argument("--max-others", type=float, default=0.15,
                   help="a run during which other processes used more than this share of the cores "
                        "is repeated (see --retries)")
    p.add_argument("--retries", type=int, default=None, help="repeats of a noisy run (default 1; quick 0)")
    p.add_argument("--nice", type=int, default=0,
                   help="scheduling priority of the runs (e.g. -5 as root, so a shared box's other "
                        "jobs disturb the timings less; they still run)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds per run (the first DeepSpeed run JIT-compiles its Adam ops)")
    p.add_argument("--results", type=Path, default=BENCH / "results.md",
                   help="markdown file whose engine section is rewritten")
    p.add_argument("--raw", type=Path, default=BENCH / "out" / "results.json",
                   help="the run's raw per-round data (JSON), written after a run, read by --render-only")
    p.add_argument("--render-only", action="store_true",
                   help="run nothing: rewrite the table from bench/out/results.json (the last run)")
    args = p.parse_args(argv)
    args.extra_argv = [a for a in argv if a != "--quick"]
    # --quick is a smoke run: it never waits for a quiet machine nor repeats a noisy run.
    quick = {"steps": 3, "warmup": 1, "rounds": 1, "wait_idle": 0.0, "retries": 0}
    full = {"steps": 8, "warmup": 3, "rounds": 3, "wait_idle": 20.0, "retries": 1}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    raw = args.raw
    if args.render_only:
        # Re-render results.md from the last run's raw data (e.g. after changing the table).
        saved = json.loads(raw.read_text())
        for k, v in saved["args"].items():
            if k not in ("results", "render_only", "raw"):
                setattr(args, k, v)
        spec = RunSpec(**{k: tuple(v) if k == "betas" else v for k, v in saved["spec"].items()})
        results, total, when = saved["results"], saved["total_s"], saved.get("finished")
        args.machine, args.versions = saved.get("machine"), saved.get("versions")
    else:
        spec = replace(RunSpec(), micro_batch=args.micro_batch, seq_len=args.seq_len,
                       bucket_numel=int(args.bucket_numel), precision=args.precision)
        t0 = time.perf_counter()
        before = versions()
        results = run_all(args, spec)
        after = versions()
        # zeroshard may change under a long run (it is developed on the same box): say so.
        args.versions = before if before == after else f"{before}; at the end: {after.rsplit(', ', 1)[-1]}"
        total = time.perf_counter() - t0
        when = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
        raw.parent.mkdir(parents=True, exist_ok=True)
        raw.write_text(json.dumps({"spec": spec.to_dict(), "args": vars(args) | {"results": str(args.results)},
                                   "results": results, "total_s": total, "finished": when,
                                   "machine": machine(), "versions": args.versions},
                                  indent=1, default=str))
    rows = summarise(results, args.max_others)
    body = render(rows, args, spec, total, when)
    if spec.precision == "fp32":
        write_section(args.results, SECTION, body, "Training throughput and memory (bench/run.py)")
    else:
        write_section(args.results, f"{SECTION}-{spec.precision}", body,
                      f"Training throughput and memory, {spec.precision} (bench/run.py --precision "
                      f"{spec.precision})")
    print(f"\n{body}\n\n[bench] {total / 60:.1f} min; wrote {args.results}"
          f"{'' if args.render_only else f' and {raw}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
