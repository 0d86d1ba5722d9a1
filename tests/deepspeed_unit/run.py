"""Measure zeroshard against DeepSpeed's own unit tests, run from a DeepSpeed checkout.

    python tests/deepspeed_unit/run.py PATH_TO_DEEPSPEED [--files unit/...py ...] [--out DIR]
    python tests/deepspeed_unit/run.py PATH --only zs --passed-from DIR/ds.xml   # zeroshard pass only
    python tests/deepspeed_unit/run.py PATH --only zs --out ZS   # no baseline yet: zeroshard, whole list
    python tests/deepspeed_unit/run.py PATH --report --out ZS --passed-from DS/ds.log   # compare later
    python tests/deepspeed_unit/run.py PATH --report --out ZS --passed-from DS/ds.log --rerun LOG ...
    python tests/deepspeed_unit/run.py PATH --concurrent    # both passes at once (zeroshard's over the whole list)
    python tests/deepspeed_unit/run.py PATH --report        # no run: compare what --out holds

PATH holds DeepSpeed's `tests/` folder (a checkout, or `git archive HEAD tests` of one); only that
folder is used. The installed deepspeed 0.19.x package is what runs in pass 1: do not put a
checkout's own `deepspeed/` source on the path. Nothing of DeepSpeed's is copied into this repo.

Two passes, each ONE pytest process over the whole list (about 2 s per test once DeepSpeed's CPU
ops are compiled; the first pass compiles them into runs/torch_extensions/ds, kept for later
runs: minutes each on a loaded 2-core machine), both on CPU:
DS_ACCELERATOR=cpu, DeepSpeed's DistributedTest harness over gloo, DS_DISABLE_REUSE_DIST_ENV=1
(fresh ranks per test), LOCAL_SIZE=2, one thread per rank.
1. DeepSpeed itself runs the selected files; the tests that pass are the baseline.
2. The same tests run again with ZEROSHARD_AS_DEEPSPEED=1 and nothing else in between: every
   `import deepspeed` (the test modules, DeepSpeed's harness, its `init_distributed`,
   accelerator and comm) is zeroshard's alias package, as a user gets it.
The report: how many pass under each, per file, and the zeroshard failures grouped by error.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# DeepSpeed's tests on its public training surface (issue 24): checkpointing, ZeRO, half
# precision, initialize, configs and lr schedules. Directories are run whole; files about
# pipeline/tensor/expert parallelism, compression or compile elsewhere are left out.
DEFAULT_FILES = [
    "unit/checkpoint",
    "unit/runtime/zero",
    "unit/runtime/half_precision",
    "unit/v1/zero",
    "unit/v1/half_precision",
    "unit/runtime/test_ds_initialize.py",
    "unit/runtime/test_lr_schedulers.py",
    "unit/runtime/test_ds_config_dict.py",
    "unit/runtime/test_ds_config_model.py",
    "unit/runtime/test_precision_config_dynamic_scale.py",
    "unit/runtime/test_precision_config_loss_scale.py",
    "unit/runtime/test_no_sync_ctxt.py",
    "unit/runtime/test_multi_output_model.py",
    "unit/runtime/test_multiple_models.py",
    "unit/utils/test_get_optim_files.py",
]


# Imported once by the forkserver that starts the ranks (the same list for both engines).
PRELOAD = ["torch", "torch._dynamo", "deepspeed", "deepspeed.comm", "unit.common", "unit.simple_model"]


def env_for(engine: str, ext_dir: Path) -> dict[str, str]:
    """The environment of one pass: the same for both engines but for ZEROSHARD_AS_DEEPSPEED."""
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    # A private extensions dir: DeepSpeed's CPU op builders JIT-compile there, and a shared one
    # makes concurrent runs wait on each other's build locks.
    env["TORCH_EXTENSIONS_DIR"] = str(ext_dir)
    # DeepSpeed's harness ends the whole pytest session (pytest.exit) when one test outlives
    # this; a loaded 2-core machine needs minutes for a test's first JIT-compiled op.
    # zeroshard builds no ops, so its pass gets a shorter limit: a hang there costs 5 minutes, not 20.
    env.setdefault("DS_UNITTEST_TIMEOUT", "1200" if engine == "ds" else "300")
    # Fresh processes per test instead of DeepSpeed's reused pool: a reused pool keeps one
    # test's process group and module state for the next, and its teardown can hang.
    env["DS_DISABLE_REUSE_DIST_ENV"] = "1"
    # DeepSpeed's CPU accelerator counts NUMA nodes as devices (1 here), so its DistributedTest
    # skips every test of world size 2 "for lack of GPUs"; LOCAL_SIZE is its override.
    env.setdefault("LOCAL_SIZE", "2")
    env["OMP_NUM_THREADS"] = "1"   # one thread per rank
    # DeepSpeed's harness starts each test's ranks from multiprocessing's forkserver; without a
    # preload every rank of every test imports torch, torch._dynamo (the first torch optimizer's
    # add_param_group imports it), deepspeed and the harness afresh: 5-6 s per test on a quiet
    # machine, 12-25 s at load 15-20, against about 3 s at that load with the preload (zs_select.py).
    env.setdefault("ZS_DSUNIT_PRELOAD", ",".join(PRELOAD))
    # HERE holds zs_select.py, a pytest plugin that only deselects (see --select).
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    if engine == "zs":
        # Nothing in between: `import deepspeed` is zeroshard's alias package, as a user gets it.
        env["ZEROSHARD_AS_DEEPSPEED"] = "1"
        env["ZEROSHARD_ALIAS_QUIET"] = "1"
    else:
        env.pop("ZEROSHARD_AS_DEEPSPEED", None)
    return env


def run_pytest(checkout: Path, engine: str, targets: list[str], xml: Path, timeout_s: int) -> float:
    """One pytest process for the whole list (about 2 s per test; a process per file costs
    DeepSpeed's import and its op-builder checks again each time)."""
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--color=no", "-q",
           f"--junitxml={xml}", "-o", "junit_family=xunit1",
           "--continue-on-collection-errors", "-p", "zs_select", *targets]
    env = env_for(engine, ROOT / "runs" / "torch_extensions" / engine)
    start = time.perf_counter()
    with open(xml.with_suffix(".log"), "w") as log:
        try:
            subprocess.run(cmd, cwd=checkout / "tests", env=env, stdout=log,
                           stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            log.write(f"\n*** timed out after {timeout_s} s\n")
    return time.perf_counter() - start


def outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """node id -> (outcome, first line of the failure message), from a junit XML file, or from
    a pytest log (`node PASSED` lines, for a pass cut short before it wrote its XML)."""
    if xml.suffix != ".xml" or not xml.exists():
        log = xml if xml.suffix != ".xml" else xml.with_suffix(".log")
        if not log.exists():
            return {}
        text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text())
        found = re.findall(r"^(unit/\S+) (PASSED|FAILED|SKIPPED|ERROR)", text, re.M)
        return {n: ("passed" if o == "PASSED" else o.lower(), "") for n, o in found}
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        node = f"{path}::{cls}::{case.get('name')}" if cls and cls[0].isupper() else f"{path}::{case.get('name')}"
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                text = (el.get("message") or el.text or "").strip()
                msg = text.splitlines()[0][:200] if text else ""
                break
        out[node] = (outcome, msg)
    return out


def _file_rank(path: str, files: list[str]) -> tuple[int, str]:
    """Where pytest runs `path` in a pass over `files` (entries in order, a directory's files by name)."""
    for i, entry in enumerate(files):
        if path == entry or path.startswith(entry.rstrip("/") + "/"):
            return i, path
    return len(files), path


def reason(msg: str) -> str:
    """Group failure messages: strip numbers, addresses and quoted values."""
    msg = re.sub(r"0x[0-9a-f]+", "0x?", msg)
    msg = re.sub(r"\d+(\.\d+)?", "N", msg)
    return msg[:150]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkout", type=Path, help="a DeepSpeed checkout (its tests/ folder is used)")
    ap.add_argument("--files", nargs="*", default=DEFAULT_FILES, help="paths under tests/")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "deepspeed_unit")
    ap.add_argument("--only", choices=["ds", "zs"], help="run one pass only")
    ap.add_argument("--passed-from", type=Path,
                    help="DeepSpeed's junit XML (or its log, for a pass cut short): run zeroshard on its passes")
    ap.add_argument("--timeout", type=int, default=7200, help="per pass, seconds")
    ap.add_argument("--select", choices=["all", "local", "dist"], default="all",
                    help="local: only the tests that run in the pytest process (milliseconds each); "
                         "dist: only those DeepSpeed's DistributedTest runs in fresh ranks")
    ap.add_argument("--concurrent", action="store_true",
                    help="run both passes at once, zeroshard's over the whole list")
    ap.add_argument("--report", action="store_true", help="run nothing: report from --out's XML or logs")
    ap.add_argument("--rerun", type=Path, nargs="*", default=[],
                    help="with --report: logs or XMLs of later zeroshard runs of some tests (e.g. after fixes); "
                         "their outcomes replace the pass's for the tests they ran")
    args = ap.parse_args(argv)
    checkout = args.checkout.resolve()
    if not (checkout / "tests" / "unit" / "common.py").exists():
        ap.error(f"{checkout} is not a DeepSpeed checkout: tests/unit/common.py is missing")
    args.out = args.out.resolve()
    os.environ["ZS_DSUNIT_SELECT"] = args.select
    args.out.mkdir(parents=True, exist_ok=True)
    ds_xml, zs_xml = args.out / "ds.xml", args.out / "zs.xml"
    if args.concurrent and not args.report:
        # Both passes at once, zeroshard's over the whole list (its tests that DeepSpeed does not
        # pass are dropped from the report): one wall-clock span instead of two on a busy machine.
        with ThreadPoolExecutor(2) as pool:
            runs = {e: pool.submit(run_pytest, checkout, e, args.files, x, args.timeout)
                    for e, x in (("ds", ds_xml), ("zs", zs_xml))}
            for e, fut in runs.items():
                print(f"{'DeepSpeed' if e == 'ds' else 'zeroshard'} pass: {fut.result():.0f} s")
    elif args.only != "zs" and not args.report:
        t = run_pytest(checkout, "ds", args.files, ds_xml, args.timeout)
        print(f"DeepSpeed pass: {t:.0f} s")
    ds = outcomes(args.passed_from or ds_xml)
    passed = sorted(n for n, (o, _) in ds.items() if o == "passed")
    print(f"DeepSpeed on CPU: {len(ds)} tests, {len(passed)} pass, "
          f"{sum(o == 'failed' for o, _ in ds.values())} fail, {sum(o == 'skipped' for o, _ in ds.values())} skip")
    if args.only == "ds":
        return 0
    if args.only == "zs" and not passed and not args.report:
        # No baseline yet (DeepSpeed's pass still running): zeroshard over the whole list, compared
        # afterwards with --report --passed-from DS_LOG_OR_XML.
        t = run_pytest(checkout, "zs", args.files, zs_xml, args.timeout)
        print(f"zeroshard pass (whole list, no baseline): {t:.0f} s")
        return 0
    if not passed:
        return 0
    if not (args.concurrent or args.report):
        only = args.out / "ds_passed.txt"
        only.write_text("\n".join(passed) + "\n")
        os.environ["ZS_DSUNIT_ONLY"] = str(only)  # zs_select.py keeps exactly these
        t = run_pytest(checkout, "zs", sorted({n.split("::")[0] for n in passed}), zs_xml, args.timeout)
        print(f"zeroshard pass: {t:.0f} s")
    zs = outcomes(zs_xml)
    # The file the pass is in now (or ended in): before later runs' outcomes are merged in.
    last_file = _file_rank(next(reversed(zs)).split("::")[0], args.files) if zs else (-1, "")
    for later in args.rerun:
        again = outcomes(later)
        print(f"re-run {later}: {len(again)} tests replace the pass's outcomes")
        zs.update(again)
    if args.concurrent or args.report:
        # A pass cut short: compare the tests both passes reached. Both run the list in the same
        # file order, so zeroshard's pass has reached a baseline test it reports, and every test of
        # a file before the file it is in now; a test of such a file it does not report is in a
        # module that did not import under zeroshard (a failure, "not collected").
        passed = [n for n in passed if n in zs or _file_rank(n.split("::")[0], args.files) < last_file]
    ok = [n for n in passed if zs.get(n, ("missing", ""))[0] == "passed"]
    print(f"zeroshard: {len(ok)} of DeepSpeed's {len(passed)} passing tests pass")
    per_file: dict[str, Counter[str]] = defaultdict(Counter)
    groups: dict[str, list[str]] = defaultdict(list)
    for n in passed:
        o, msg = zs.get(n, ("not collected", ""))
        per_file[n.split("::")[0]][o] += 1
        if o != "passed":
            groups[reason(msg) or o].append(n)
    for f, c in sorted(per_file.items()):
        print(f"  {f}: " + ", ".join(f"{v} {k}" for k, v in sorted(c.items())))
    print("zeroshard failures by reason:")
    for r, nodes in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(nodes):4d}  {r}   (e.g. {nodes[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
