"""`zeroshard plan --probe` end to end: real 2-rank runs of the candidates under the launcher."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from zeroshard.config import load_config


def run_plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zeroshard.cli.main", "plan", "--model", "gpt:tiny",
                           "--devices", "2", "--cpu-memory", "8GB", "--global-batch", "8", "--probe",
                           "--probe-max", "2", "--probe-steps", "3", *args],
                          text=True, capture_output=True, timeout=400)


def test_probe_picks_the_fastest_candidate_that_ran(tmp_path: Path) -> None:
    out = tmp_path / "ds_config.json"
    proc = run_plan("--device-memory", "4GB", "--out", str(out))
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    runs = re.findall(r"^probe (stage .+?), micro batch (\d+): ([0-9.]+) samples/s, peak", text, re.M)
    assert len(runs) == 2, text
    best = max(runs, key=lambda r: float(r[2]))
    assert f"probe choice: {best[0]}, micro batch {best[1]}: {best[2]} samples/s" in text
    written = json.loads(out.read_text())
    assert f"wrote {out} ({best[0]}," in text
    cfg = load_config(written, dp_world_size=2)
    assert cfg.train_batch_size == 8


def test_probe_over_budget_runs_are_caught(tmp_path: Path) -> None:
    # 64 MB per device: the estimate says the tiny model fits, but a real process (interpreter
    # and torch included) peaks far above it, so every probe run is over budget and the plan
    # falls back to the estimate's choice.
    proc = run_plan("--device-memory", "64MB")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert len(re.findall(r"probe .+: over budget \(peak .+ > --device-memory 64.0 MB\)", text)) == 2, text
    assert "probe: no candidate ran; keeping the estimate's choice" in text
