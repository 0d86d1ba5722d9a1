"""bench/gpu/run.py, the GPU benchmark harness, run end to end on a CPU with a tiny model.

The benchmark itself needs a GPU (tokens/s, MFU, max_memory_allocated on an H100); this keeps
its harness working where there is none: rows run as torchrun jobs, results are collected, the
ratio columns are computed and the table (with the machine line) is written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_writes_the_table(tmp_path: Path) -> None:
    results = tmp_path / "results.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/gpu/run.py"), "--smoke", "--rows", "zs0", "zs3", "fsdp2",
         "--out-dir", str(tmp_path / "out"), "--results", str(results)],
        text=True, capture_output=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["row"] for r in rows] == ["zs0", "zs3", "fsdp2"]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows), rows
    # The zeroshard runs learn the same seeded batches (loss is finite and moves).
    assert all(len(r["losses"]) == 3 and r["losses"][0] != r["losses"][-1] for r in rows)
    table = results.read_text()
    assert "| zs3 | ok |" in table and "| fsdp2 | ok |" in table
    assert "Machine: " in table and "torch 2." in table
    fsdp_ratio = table.split("| zs3 | ok |")[1].splitlines()[0].rstrip(" |").split("|")[-1].strip()
    expected = rows[1]["tokens_per_s"] / rows[2]["tokens_per_s"]
    assert abs(float(fsdp_ratio) - expected) < 0.01, (fsdp_ratio, expected)
