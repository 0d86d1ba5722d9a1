"""bench/moe_traffic.py, the MoE traffic benchmark, at its smallest size (2 ranks, ~20-50 s on 2 cores).

Opt-in (Note: [benchmark smoke runs are opt-in] in tests/conftest.py): it checks the bench's plumbing
(two torchrun jobs, the comm log read per step, the bytes split into expert and other, the table),
not zeroshard, whose AutoEP numerics tests/dist/test_autoep.py covers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_splits_expert_bytes(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench/moe_traffic.py"), "--smoke", "--out-dir", str(tmp_path)],
                          text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["case"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    dense, ep = rows["dense_z3"]["bytes"], rows["ep_z3"]["bytes"]
    # Dense ZeRO-3 gathers the one layer's whole bank (and reduces its gradient); AutoEP at EP = world
    # gathers no expert and moves tokens by all-to-all instead.
    bank = rows["dense_z3"]["bank_bytes"]
    assert dense["expert"]["all_gather"] == bank and sum(dense["expert"].values()) == 2 * bank
    assert "all_gather" not in ep["expert"] and ep["expert"]["all_to_all"] > 0
    assert "all_to_all" not in dense["expert"]
    # The same seed and batches: AutoEP trains the same model (tests/dist/test_autoep.py's oracle).
    assert abs(rows["dense_z3"]["losses"][-1] - rows["ep_z3"]["losses"][-1]) < 1e-4
    assert "| `ep_z3` | 2 |" in proc.stdout and "Machine: " in proc.stdout
