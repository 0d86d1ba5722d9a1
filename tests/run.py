"""Run the whole test suite: unit tests, distributed tests at 2 and 3 ranks, launcher tests.

    python tests/run.py            # everything (README's test command)
    python tests/run.py unit dist2 # some stages

The distributed tests share one gloo process group per run (process start-up dominates on a
small CPU box), so they run under torchrun, not plain pytest. On a machine without torch or
zeroshard installed, this installs them first (torch 2.13.0, the CPU build on the CI image).
The last line is the total over every stage: "total: N passed, N failed, N skipped".
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]


def torchrun(n: int) -> list[str]:
    # Rank 0 prints; the others run the same tests silently (a failure on any rank fails the run).
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
            "--local-ranks-filter=0"]


STAGES: dict[str, list[str]] = {
    "unit": [sys.executable, *PYTEST, "tests/unit"],
    "dist1": [sys.executable, *PYTEST, "tests/dist"],  # world size 1: no process group at all
    "dist2": [*torchrun(2), *PYTEST, "tests/dist"],
    "dist3": [*torchrun(3), *PYTEST, "tests/dist"],
    "launch": [sys.executable, *PYTEST, "tests/launch"],
    # CUDA/NCCL paths: every test skips, with its reason printed (-rs), where there is no GPU.
    # On a machine with N GPUs, also run them at world size N:
    #   torchrun --standalone --nproc-per-node=N -m pytest tests/gpu -x -q
    "gpu": [sys.executable, *PYTEST, "-rs", "tests/gpu"],
}


def ensure_installed() -> None:
    try:
        import torch  # noqa: F401

        import zeroshard  # noqa: F401
    except ImportError:
        print("installing torch==2.13.0 and zeroshard[test] ...", flush=True)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "torch==2.13.0",
                               "-e", f"{ROOT}[test]"])


def counts(output: str) -> dict[str, int]:
    """pytest's closing counts, from the last summary line of one run (rank 0's under torchrun)."""
    found: dict[str, int] = {}
    for line in output.splitlines():
        if re.search(r"\d+ (passed|failed|errors?|skipped)", line) and " in " in line:
            found = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", line)}
    return found


def main(argv: list[str]) -> int:
    ensure_installed()
    stages = argv or list(STAGES)
    total = {"passed": 0, "failed": 0, "skipped": 0}
    ok = True
    for name in stages:
        start = time.perf_counter()
        print(f"=== {name}: {' '.join(STAGES[name][1:])}", flush=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(STAGES[name], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out = proc.stdout
        c = counts(out)
        print(out if proc.returncode else "\n".join(out.splitlines()[-3:]), flush=True)
        if proc.returncode != 0 or not c:
            ok = False
            c.setdefault("failed", max(1, c.get("failed", 0)))
        for key in total:
            total[key] += c.get(key, 0) + (c.get("errors", 0) + c.get("error", 0) if key == "failed" else 0)
        print(f"=== {name}: exit {proc.returncode}, {time.perf_counter() - start:.0f} s", flush=True)
    print(f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
