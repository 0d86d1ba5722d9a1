"""Run the whole test suite: unit tests, distributed tests at 2 and 3 ranks (the pipeline, tensor-parallel
and 3D tests also at 4, the 3D tests also at 8), launcher tests.

    python tests/run.py            # everything (README's test command)
    python tests/run.py unit dist2 # some stages
    python tests/run.py --deepspeed  # everything, plus the differential suite against DeepSpeed
    python tests/run.py deepspeed  # the differential suite only (needs DeepSpeed 0.19, opt-in)
    python tests/run.py bench      # the benchmark harnesses' smoke runs on CPU (GPU harness, MoE traffic; opt-in)

The distributed tests share one gloo process group per run (process start-up dominates on a
small CPU box), so they run under torchrun, not plain pytest. On a machine without torch or
zeroshard installed, this installs them first (torch 2.13.0, the CPU build on the CI image).
The launch stage (jobs that mostly wait: start-up, rendezvous, timeouts) runs in a thread beside
the other stages, which run one after the other (unit and dist1 together): see BESIDE.
The closing summary has one row per stage (counts and wall time); the last line is the total
over every stage: "total: N passed, N failed, N skipped".

Every stage runs with -x: in a distributed stage a failure on one rank would otherwise pair its
peers' collectives with the next test. So that one failure never hides the rest, a stage that
stops early is restarted (a fresh process group) with every test that already ran deselected,
until every test has run once. Counts come from rank 0's per-test log (tests/conftest.py), so
each test is counted exactly once; a test that started and never reported (a crash) counts as
failed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torchrun_cmd import torchrun

ROOT = Path(__file__).resolve().parents[1]
PYTEST = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]


DIST3_SKIP = (
    "test_activation_checkpointing.py",  # recompute equals no recompute: per rank, whatever the world
    "test_nvme.py", "test_nvme_params.py",  # the swap path is per rank; partition sizes come from zero/
    "test_deepspeed_api.py", "test_safe_accessors.py",  # API shape and accessors (uneven: test_zero*.py)
    "test_estimate_engine.py", "test_engine.py",  # the estimator's and progress lines' plumbing
    "test_moe.py",  # EP = world size needs an even world (EP 2 x EDP 2 and EP 4: dist4)
    "test_moe_telemetry.py",  # EP = world size too; the sum over ranks is the same at 2
    "test_autoep.py",  # 4 experts do not split over 3 ranks (EP 2 x EDP 2: dist4)
    "test_sequence_parallel.py", "test_alst.py",  # SP 2 and 4 need an even world (SP 2 x DP 2 and SP 4: dist4)
)

FAULT_FILES = (
    "test_elastic_launch.py", "test_comm_divergence.py", "test_checkpoint_fault.py",
    "test_checkpoint_auto_resume.py", "test_preemption.py", "test_pipeline_dead_stage.py",
    "test_user_collectives.py", "test_two_node.py", "test_two_node_netns.py", "test_moe_world_change.py",
    "test_checkpoint_reshard.py", "test_checkpoint_resume.py",
)
"""tests/launch files whose jobs fail on purpose and wait for the consequences (the "faults" stage)."""

STAGES: dict[str, list[str]] = {
    # CUDA/NCCL paths: every test skips, with its reason printed (-rs), where there is no GPU.
    # On a machine with N GPUs, also run them at world size N:
    #   torchrun --standalone --nproc-per-node=N -m pytest tests/gpu -x -q
    # First, not last: CI reads the last pytest closing line, and on a machine without CUDA this
    # stage's line ("29 skipped") would read as a run that executed no test.
    "gpu": [sys.executable, *PYTEST, "-rs", "tests/gpu"],
    "unit": [sys.executable, *PYTEST, "tests/unit"],
    "dist1": [sys.executable, *PYTEST, "tests/dist"],  # world size 1: no process group at all
    # Rank 0 prints; the others run the same tests silently (a failure on any rank fails the run).
    "dist2": torchrun(2, *PYTEST, "tests/dist", rank0_output=True),
    # Three ranks exist for uneven partitions (padding, a parameter straddling shard boundaries, PP 3,
    # TP 3). Files whose behaviour does not change past two ranks run at 1 and 2 only: they were a third
    # of this stage's time (tests/run.py prints each stage's slowest tests).
    "dist3": torchrun(3, *PYTEST, "tests/dist", *(f"--ignore=tests/dist/{f}" for f in DIST3_SKIP), rank0_output=True),
    # Pipeline x data (PP 2 x DP 2, PP 4), tensor x data parallelism (TP 2 x DP 2), 3D (PP 2 x TP 2) and
    # sequence x data parallelism (SP 2 x DP 2, SP 4, ALST at SP 4, the 2D Ulysses x ring layout),
    # MoE with experts replicated over expert-data-parallel pairs (EP 2 x 2, EP 2 <-> 4 checkpoints,
    # DeepSpeed's EP-2 MoE checkpoint loaded at EP 2 x EDP 2, AutoEP's EP 2 x EDP 2 and EP 4),
    # EP 2 beside TP 2 and in PP 2 x DP 2,
    # engine.compile() at TP 2 x DP 2 and PP 2 x DP 2
    # need 4 ranks; the rest of tests/dist runs at 1-3 ranks, so this stage runs only those files,
    # and the shared-memory collectives (a sum of 4 terms, 4 rows of the arena).
    "dist4": torchrun(4, *PYTEST, "tests/dist/test_pipeline.py", "tests/dist/test_pipe_grid.py",
                      "tests/dist/test_ulysses.py", "tests/dist/test_pipeline_failures.py",
                      "tests/dist/test_tensor_parallel.py", "tests/dist/test_3d.py",
                      "tests/dist/test_memory_census_3d.py", "tests/dist/test_shm.py",
                      "tests/dist/test_sequence_parallel.py", "tests/dist/test_alst.py",
                      "tests/dist/test_ring_attention.py", "tests/dist/test_moe.py",
                      "tests/dist/test_moe_ds_checkpoint.py", "tests/dist/test_autoep.py",
                      "tests/dist/test_ep_tensor_parallel.py", "tests/dist/test_ep_pipeline.py",
                      "tests/dist/test_compile.py", rank0_output=True),
    # 3D at PP 2 x DP 2 x TP 2 (dist4 runs PP 2 x TP 2): the claim "equal to one process at 8 ranks"
    # needs 8 ranks; about 130 CPU-seconds, half of it starting 8 interpreters.
    "dist8": torchrun(8, *PYTEST, "tests/dist/test_3d.py", rank0_output=True),
    # Jobs that kill, stop or lose ranks and nodes and wait for what follows (rendezvous, heartbeats,
    # timeouts, restarts): mostly waiting, so they run in a lane of their own beside "launch".
    "faults": [sys.executable, *PYTEST, *(f"tests/launch/{f}" for f in FAULT_FILES)],
    # The client flows (Trainer, Accelerate, PEFT, TRL, LLaMA-Factory, DeepSpeed-Chat, from_pretrained,
    # the training CLI): jobs that start real clients, mostly computing.
    "launch": [sys.executable, *PYTEST, "tests/launch", *(f"--ignore=tests/launch/{f}" for f in FAULT_FILES)],
}
# Opt-in: zeroshard against DeepSpeed 0.19 on the same cases (tests/differential/harness.py).
# Not -x: each case is one test, and one deviating case must not hide the others.
OPT_IN: dict[str, list[str]] = {
    "deepspeed": [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/differential"],
    # Note: [benchmark smoke runs are opt-in] in tests/conftest.py.
    "bench": [sys.executable, *PYTEST, "tests/launch/test_gpu_bench_harness.py",
              "tests/launch/test_moe_traffic_bench.py"],
}


def ensure_installed() -> None:
    try:
        import torch  # noqa: F401  only whether it is installed

        import zeroshard  # noqa: F401  only whether it is installed
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


def slowest(path: Path, count: int = 5) -> list[tuple[float, str]]:
    """The `count` slowest tests (call phase) of one round's log: where a stage's time goes."""
    times: list[tuple[float, str]] = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("when") == "call" and "seconds" in record:
                times.append((float(record["seconds"]), record["nodeid"]))
    return sorted(times, reverse=True)[:count]


def read_log(path: Path) -> dict[str, str]:
    """nodeid -> outcome ("passed", "failed", "skipped") for every test that started."""
    result: dict[str, str | None] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash
                continue
            if "start" in record:
                result.setdefault(record["start"], None)
            elif record["outcome"] == "failed" or result.get(record["nodeid"]) != "failed":
                result[record["nodeid"]] = record["outcome"]
    # Started and never reported: the process died inside the test.
    return {nodeid: outcome or "failed" for nodeid, outcome in result.items()}


_OUTPUT = threading.Lock()


def say(text: str) -> None:
    """Print one block whole: stages running at the same time print between each other's blocks,
    never inside them (print writes its text and its newline separately)."""
    with _OUTPUT:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()


def run_stage(name: str) -> tuple[dict[str, int], bool]:
    """Run one stage, restarting after each early stop; return its counts and whether it passed."""
    ran: dict[str, str] = {}
    ok, rounds = True, 0
    with tempfile.TemporaryDirectory(prefix="zeroshard-tests-") as tmp:
        while True:
            rounds += 1
            log = Path(tmp) / f"round{rounds}.jsonl"
            # PYTHONFAULTHANDLER: a job that dies on a signal (a rare "terminate called" SIGABRT at
            # exit is not yet explained) prints every thread's Python stack into the test's output.
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                   "ZEROSHARD_TEST_LOG": str(log), "PYTHONFAULTHANDLER": "1"}
            deselect = [arg for nodeid in ran for arg in ("--deselect", nodeid)]
            if rounds > 1:
                say(f"=== {name}: restarting with a fresh group after the failure, {len(ran)} tests already run")
            proc = subprocess.run([*STAGES.get(name, OPT_IN.get(name, [])), *deselect], cwd=ROOT, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            out = proc.stdout
            this_round = read_log(log)
            say("\n".join([out if proc.returncode or name in OPT_IN else "\n".join(out.splitlines()[-3:]),
                           *(f"    {seconds:7.1f} s  {nodeid}" for seconds, nodeid in slowest(log))]))
            ran.update(this_round)
            if rounds > 1 and not this_round and re.search(r"no tests ran|\d+ deselected in", out):
                break  # the failing test was the stage's last one
            if proc.returncode != 0:
                ok = False
            summary = counts(out)
            stopped_early = proc.returncode != 0 and "failed" in this_round.values()
            if not stopped_early or not this_round:
                if proc.returncode != 0 and not this_round and not summary:
                    ran[f"{name}: exit {proc.returncode} before any test ran"] = "failed"
                break
    c = {"passed": 0, "failed": 0, "skipped": 0}
    for outcome in ran.values():
        c[outcome] = c.get(outcome, 0) + 1
    if not ok and c["failed"] == 0:
        c["failed"] = 1  # a non-zero exit with every test passing (a rank crashed at exit)
    return c, ok


def summary_table(rows: list[tuple[str, dict[str, int], bool, float]], total_wall: float) -> str:
    """One row per stage that ran: its counts, whether it passed and its wall time; then the whole
    run's wall time (less than the sum where stages ran together). (README's Tests section quotes it.)"""
    lines = [f"{'stage':<10} {'passed':>7} {'failed':>7} {'skipped':>8}  {'result':<6} {'wall':>8}"]
    for name, c, stage_ok, wall in rows:
        lines.append(f"{name:<10} {c['passed']:>7} {c['failed']:>7} {c['skipped']:>8}  "
                     f"{'ok' if stage_ok else 'FAILED':<6} {wall:>6.0f} s")
    lines.append(f"{'all':<10} {'':>7} {'':>7} {'':>8}  {'':<6} {total_wall:>6.0f} s")
    return "\n".join(lines)


TOGETHER = ("unit", "dist1")
"""Single-process stages run at the same time (each takes one core of the 2-core CI box)."""

BESIDE = ("launch", "faults")
"""Stages that start with the run and go on in threads beside the others (which keep their order).
The launch stages are their own jobs' start-up, rendezvous, heartbeat and timeout waits, and watching
for a rank's report: they leave much of the box idle while they wait, which the other stages fill.
They were one stage until 2026-12-07, and then the longest path of the run (over 40 minutes of the
~45 on a 2-core box): the fault jobs' waits now overlap the client flows' computing.
Its jobs take free ports (torchrun --standalone, the launcher's free port on one node), like the
distributed stages', so the two never meet on a port; each job has its own temporary directory."""


def timed_stage(name: str, command: list[str]) -> tuple[str, dict[str, int], bool, float]:
    start = time.perf_counter()
    say(f"=== {name}: {' '.join(command[1:])}")
    c, stage_ok = run_stage(name)
    wall = time.perf_counter() - start
    say(f"=== {name}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped, "
        f"{'ok' if stage_ok else 'FAILED'}, {wall:.0f} s")
    return name, c, stage_ok, wall


def main(argv: list[str]) -> int:
    ensure_installed()
    stages = [a for a in argv if a != "--deepspeed"] or list(STAGES)
    if "--deepspeed" in argv:
        stages.append("deepspeed")
    if "deepspeed" in stages:
        # Note: [DeepSpeed comparison tests are opt-in] (tests/conftest.py): the stages of this
        # run also run their tests marked `deepspeed`.
        os.environ["ZEROSHARD_DEEPSPEED_TESTS"] = "1"
    if "bench" in stages:
        os.environ["ZEROSHARD_BENCH_TESTS"] = "1"
    commands = {**STAGES, **OPT_IN}
    unknown = [name for name in stages if name not in commands]
    if unknown:
        print(f"unknown stage(s) {', '.join(unknown)}: expected some of {', '.join(commands)}", file=sys.stderr)
        return 2
    run_start = time.perf_counter()
    total = {"passed": 0, "failed": 0, "skipped": 0}
    results: dict[str, tuple[str, dict[str, int], bool, float]] = {}
    ok = True
    beside = [n for n in stages if n in BESIDE]
    done: set[str] = set(beside)
    with ThreadPoolExecutor(max(1, len(beside))) as beside_pool:
        started = {n: beside_pool.submit(timed_stage, n, commands[n]) for n in beside}
        for name in stages:
            if name in done:
                continue
            batch = [n for n in stages if n in TOGETHER] if name in TOGETHER else [name]
            done.update(batch)
            with ThreadPoolExecutor(len(batch)) as pool:
                results.update((r[0], r) for r in pool.map(lambda n: timed_stage(n, commands[n]), batch))
        results.update((n, future.result()) for n, future in started.items())
    rows = [results[n] for n in dict.fromkeys(stages)]  # in the order asked for, each stage once
    for _, c, stage_ok, _ in rows:
        ok = ok and stage_ok
        for key in total:
            total[key] += c[key]
    print(summary_table(rows, time.perf_counter() - run_start))
    print(f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
