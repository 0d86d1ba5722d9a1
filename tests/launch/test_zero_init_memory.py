"""zero.Init keeps construction memory near 1/N of the model plus its largest layer."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from torchrun_cmd import torchrun

from zeroshard.comm import shm

SCRIPT = Path(__file__).parent / "scripts" / "zero_init_memory.py"


def peak_growth(mode: str) -> list[dict[str, int]]:
    # Large blocks straight from mmap, so freed tensors leave RSS at once (glibc otherwise
    # keeps freed heap pages, and peak RSS would measure the allocator, not zeroshard).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
    proc = subprocess.run(torchrun(2, str(SCRIPT), mode), capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"RESULT rank=(\d) init=\w+ peak_growth=(\d+) model=(\d+) largest=(\d+) world=(\d)", proc.stdout)
    assert len(rows) == 2, proc.stdout
    return [dict(zip(("rank", "peak", "model", "largest", "world"), map(int, r))) for r in rows]


def arena_bytes(world: int) -> int:
    """The rows and one rank's sum scratch of a group's arena (0 where it is off)."""
    half = shm.half_bytes_for(world, 1 << 62) if shm.wanted() else 0
    return shm.arena_bytes(world, half) + (half // world if half else 0)


def test_construction_peak_is_a_shard_plus_a_layer() -> None:
    whole = peak_growth("whole")
    cut = peak_growth("init")
    for w, c in zip(whole, cut):
        model, largest, world = c["model"], c["largest"], c["world"]
        assert w["peak"] >= 0.9 * model, "without zero.Init every rank holds the whole model"
        # Budget: half the model would not fit; zero.Init stays near model/N + one layer
        # (+ one more layer in flight, and allocator slack), + the group's shared-memory arena,
        # which every rank maps and touches (Note: [shared-memory collectives] in comm/shm.py).
        budget = model / world + 3 * largest + arena_bytes(world)
        assert c["peak"] <= budget, (c, budget)
        assert c["peak"] < 0.75 * w["peak"]
