"""Run the differential cases through DeepSpeed and zeroshard, compare, print the table.

    python tests/differential/harness.py                 # every case (one 2-rank job per engine)
    python tests/differential/harness.py --cases s2_fp32 lr_range_test
    python tests/differential/harness.py --reuse --out DIR  # compare an earlier run's records again
    python tests/differential/harness.py --engines zs     # rerun zeroshard only, reuse DeepSpeed's

Needs DeepSpeed 0.19.x (`pip install -e ".[bench]"`), never a dependency of zeroshard. Both jobs
run on CPU over gloo with one thread per rank (DS_ACCELERATOR=cpu). DeepSpeed JIT-builds its
CPU Adam on first use (minutes on 2 cores); the build is cached in TORCH_EXTENSIONS_DIR, by
default `.ds_build/` in the checkout (git-ignored). Exit status 1 on any mismatch.
`python tests/run.py deepspeed` runs it through pytest (tests/differential/test_differential.py).
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

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # tests/torchrun_cmd.py, also when run as a script
from cases import BY_NAME, CASES, Case  # noqa: E402  the sibling modules load after the sys.path insert
from compare import Result, compare_case, table  # noqa: E402  the sibling modules load after the sys.path insert
from torchrun_cmd import torchrun  # noqa: E402  the sibling modules load after the sys.path insert

JOB_TIMEOUT_S = 1800


def run_worker(worker: str, engine: str, out_dir: Path, timeout: int = JOB_TIMEOUT_S) -> Any:
    """One 2-rank torchrun job of a sibling worker script (`worker`, run with ``--engine ENGINE
    --out OUT_DIR``) that writes OUT_DIR/<engine>.json on rank 0; its output goes to
    OUT_DIR/<engine>.log. Returns the records.

    Raises:
        AssertionError: the job wrote no records (the log says why).
    """
    out = out_dir / f"{engine}.json"
    out.unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(HERE / worker), "--engine", engine, "--out", str(out_dir)]
    with open(out_dir / f"{engine}.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=job_env(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    assert out.exists(), f"the {engine} job wrote no records; see {out_dir / f'{engine}.log'}"
    return json.loads(out.read_text())


def job_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".ds_build"))
    env["DS_ACCELERATOR"] = "cpu"
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_engine(engine: str, out_dir: Path, cases: list[Case]) -> float:
    """One torchrun job (2 ranks) running every case under `engine`; returns its wall time."""
    out = out_dir / f"{engine}.json"
    cmd = torchrun(2, str(HERE / "worker.py"), "--engine", engine, "--out", str(out),
                   "--cases", *[c.name for c in cases])
    start = time.perf_counter()
    with open(out_dir / f"{engine}.log", "w") as log:
        try:
            subprocess.run(cmd, cwd=ROOT, env=job_env(), stdout=log, stderr=subprocess.STDOUT,
                           timeout=JOB_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            log.write(f"\n*** {engine} job timed out after {JOB_TIMEOUT_S} s\n")
    return time.perf_counter() - start


def load(out_dir: Path, engine: str) -> tuple[dict[str, Any], dict[str, Any]]:
    path = out_dir / f"{engine}.json"
    records = json.loads(path.read_text()) if path.exists() else {}
    wpath = out_dir / f"{engine}.json.weights.pt"
    weights = torch.load(wpath) if wpath.exists() else {}
    return records, weights


def compare_all(out_dir: Path, cases: list[Case]) -> list[Result]:
    zs, zs_w = load(out_dir, "zs")
    ds, ds_w = load(out_dir, "ds")
    results = []
    for c in cases:
        ref = c.ds_reference or c.name
        results.append(compare_case(c, zs.get(c.name), ds.get(ref), zs_w.get(c.name), ds_w.get(ref),
                                    ds_own=ds.get(c.name)))
    return results


def run(out_dir: Path, cases: list[Case], engines: tuple[str, ...] = ("ds", "zs")
        ) -> tuple[list[Result], dict[str, float]]:
    """Run `engines` (the others' records must already be in out_dir), then compare."""
    out_dir.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    for engine in engines:
        times[engine] = run_engine(engine, out_dir, cases)
    return compare_all(out_dir, cases), times


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", help="case names (default: all)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "differential"), help="records and logs")
    ap.add_argument("--engines", nargs="*", choices=["ds", "zs"], default=["ds", "zs"],
                    help="engines to run; the other's records are reused from --out")
    ap.add_argument("--reuse", action="store_true", help="run nothing: compare the records in --out")
    args = ap.parse_args(argv)
    cases = [BY_NAME[n] for n in args.cases] if args.cases else CASES
    # DeepSpeed must also run the cases that others are compared with.
    refs = [BY_NAME[c.ds_reference] for c in cases if c.ds_reference and c.ds_reference not in
            {x.name for x in cases}]
    cases = cases + list({c.name: c for c in refs}.values())
    results, times = run(Path(args.out), cases, () if args.reuse else tuple(args.engines))
    print(table(results))
    for engine, s in times.items():
        print(f"{engine} job: {s:.0f} s")
    bad = [r for r in results if r.ok == (r.case.xfail is not None)]
    print(f"{len(results)} cases, {len(bad)} unexpected ({', '.join(r.case.name for r in bad) or 'none'})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
