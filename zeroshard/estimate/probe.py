"""`zeroshard plan --probe`: run a few real steps of each candidate and keep the fastest that ran.

Every candidate the estimate expects to fit is run under the launcher
(`python -m torch.distributed.run --standalone`, one node), most frugal first, each in its own
process group with a time limit. A run that goes out of memory (a CUDA OOM, the kernel's OOM
killer, or on a CPU-only machine a peak RSS above `--device-memory`) or fails is reported and
skipped; the fastest run in samples/s wins. Imports `zeroshard.estimate` only; the training
happens in estimate/probe_worker.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroshard.errors import ZeroshardError
from zeroshard.estimate.plan import Decision, Hardware, format_gb
from zeroshard.progress import Progress

KILLED = (-signal.SIGKILL, 128 + signal.SIGKILL)


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    decision: Decision
    status: str
    """"ok", "oom", "over budget", "timeout" or "failed"."""
    samples_per_s: float = 0.0
    peak_bytes: int = 0
    baseline_bytes: int = 0
    """CPU only: the process's peak before the model was built (interpreter and torch)."""
    detail: str = ""

    def line(self) -> str:
        d = self.decision
        head = f"probe {d.name}, micro batch {d.micro_batch}:"
        if self.status == "ok":
            above = (f", {format_gb(self.peak_bytes - self.baseline_bytes)} above the interpreter's"
                     if self.baseline_bytes else "")
            return (f"{head} {self.samples_per_s:.1f} samples/s, peak {format_gb(self.peak_bytes)} per rank"
                    f"{above} (estimated {format_gb(d.device_need)})")
        return f"{head} {self.status}" + (f" ({self.detail})" if self.detail else "")


def probe_command(config_path: Path, model: str, seq_len: int, out: Path, hw: Hardware, steps: int,
                  warmup: int) -> list[str]:
    """The launcher command line for one probe run."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={hw.devices_per_node}", "-m", "zeroshard.estimate.probe_worker",
            "--config", str(config_path), "--model", model, "--seq-len", str(seq_len), "--out", str(out),
            "--steps", str(steps), "--warmup", str(warmup), "--device-memory", str(hw.device_memory)]


def _env(hw: Hardware) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // hw.devices_per_node)))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _read_result(out: Path, world: int) -> dict[str, Any] | None:
    """Rank 0's result, unless another rank reported a failure (its own file)."""
    for path in [out] + [Path(f"{out}.rank{r}") for r in range(1, world)]:
        if path.exists():
            data: dict[str, Any] = json.loads(path.read_text())
            if data.get("status") != "ok" or path == out:
                return data
    return None


def run_probe(d: Decision, model: str, seq_len: int, hw: Hardware, *, steps: int = 4, warmup: int = 2,
              timeout_s: float = 300.0) -> ProbeResult:
    """Run one candidate; never raises for a failed run (the result says what happened)."""
    if d.ds_config is None:
        raise ZeroshardError(f"{d.name}: no ds_config to probe")
    with tempfile.TemporaryDirectory(prefix="zeroshard-probe-") as tmp:
        cfg_path, out = Path(tmp) / "ds_config.json", Path(tmp) / "result.json"
        cfg_path.write_text(json.dumps(d.ds_config, indent=2))
        cmd = probe_command(cfg_path, model, seq_len, out, hw, steps, warmup)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=_env(hw), start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers: our own session
            proc.communicate()
            return ProbeResult(decision=d, status="timeout", detail=f"over {timeout_s:.0f} s")
        result = _read_result(out, hw.devices_per_node)
    if result is None or result.get("status") != "ok":
        if result is not None and result.get("status") == "oom":
            return ProbeResult(decision=d, status="oom", detail=str(result.get("error", ""))[:120])
        if proc.returncode in KILLED or "SIGKILL" in log or "Signals.SIGKILL" in log:
            return ProbeResult(decision=d, status="oom", detail="killed by the OS (out of memory)")
        last = next((ln for ln in reversed(log.splitlines()) if "Error" in ln), log.strip().splitlines()[-1:] or [""])
        detail = last if isinstance(last, str) else last[0]
        return ProbeResult(decision=d, status="failed", detail=f"exit {proc.returncode}: {detail.strip()[:160]}")
    peaks = [int(p) for p in result["peak_memory_bytes_per_rank"]]
    peak = max(peaks)
    if peak > hw.device_memory:
        return ProbeResult(decision=d, status="over budget", peak_bytes=peak,
                           detail=f"peak {format_gb(peak)} > --device-memory {format_gb(hw.device_memory)}")
    return ProbeResult(decision=d, status="ok", samples_per_s=float(result["samples_per_s"]),
                       peak_bytes=peak, baseline_bytes=int(result.get("baseline_bytes", 0)))


def probe_all(candidates: list[Decision], model: str, seq_len: int, hw: Hardware, *, steps: int = 4,
              warmup: int = 2, timeout_s: float = 300.0,
              report: Callable[[str], None] = print) -> tuple[list[ProbeResult], ProbeResult | None]:
    """Probe `candidates` most frugal first; return every result and the fastest that ran."""
    if hw.nodes != 1:
        raise ZeroshardError("--probe runs on this node only; plan for one node, or drop --probe")
    order = sorted(candidates, key=lambda d: d.device_need)
    results = []
    # The report lines are the per-stage lines; on a terminal a bar shows where the walk is.
    with Progress(len(order), "plan --probe", sys.stderr.isatty(), unit="candidate") as bar:
        for d in order:
            r = run_probe(d, model, seq_len, hw, steps=steps, warmup=warmup, timeout_s=timeout_s)
            report(r.line())
            results.append(r)
            bar.advance(1, d.name)
    ran = [r for r in results if r.status == "ok"]
    return results, max(ran, key=lambda r: r.samples_per_s) if ran else None
