"""Launch-test worker: SIGKILL inside save_checkpoint at many points; the last complete
checkpoint must load every time, and training must resume from it.

    ckpt_fault.py DIR POINTS SEED [async]
                                      world size 1, plain python (no process group); kills at
                                      every non-write file event and at POINTS random writes

With `async` (checkpoint.async_save), the child saves, trains step 4 while the background thread
writes, then joins (engine.wait_for_checkpoint): a kill lands in the snapshot's preparation, in
the writer thread while training runs, or in the join's publish. A published global_step3 must
hold step 3's weights, not step 4's.

The parent trains 2 steps and saves `global_step2` (complete). For each kill point k, a forked
child (the same engine state, no re-import) trains step 3 and saves `global_step3` into a copy
of that directory with ZEROSHARD_CHECKPOINT_FAULT_AT=k: it SIGKILLs itself at its k-th file
event (open / write / fsync / rename / mkdir / remove). The parent then loads `latest` into a
fresh engine: it must be global_step2 with the saved weights (then one step must reproduce
step 3 exactly) or, if the kill came after `latest` was replaced, global_step3 exactly.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dist"))

from engine_helpers import global_batches, init_engine, make_config, make_model, train_engine

from zeroshard.checkpoint import files
from zeroshard.errors import CheckpointError

ASYNC = len(sys.argv) > 4 and sys.argv[4] == "async"
CONFIG = make_config(bf16={"enabled": True}, zero_optimization={
    "stage": 2, "reduce_bucket_size": 300, "offload_optimizer": {"device": "cpu"}},
    **({"checkpoint": {"async_save": True}} if ASYNC else {}))
BATCHES = global_batches(4, 2)  # the 4th: trained while an asynchronous save writes


def snapshot(engine: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def child_save(engine: Any, where: Path, fault_at: int | None, report: Path | None, tag: str | None) -> None:
    """In a forked child: step 3, save; never returns."""
    code = 0
    try:
        if fault_at is not None:
            os.environ[files.FAULT_ENV] = str(fault_at)
        train_engine(engine, BATCHES[2:3], 0, 1)
        step3 = snapshot(engine)
        engine.save_checkpoint(where, tag=tag)
        if ASYNC:  # training goes on while the writer thread works; then the join publishes
            train_engine(engine, BATCHES[3:4], 0, 1)
            engine.wait_for_checkpoint()
        if report is not None:
            torch.save({"events": files.events(), "params": step3}, report)
    except BaseException as e:  # report anything, exit non-zero
        print(f"child failed: {type(e).__name__}: {e}", flush=True)
        code = 3
    os._exit(code)


def fork_save(engine: Any, where: Path, fault_at: int | None, report: Path | None = None,
              tag: str | None = None) -> int:
    pid = os.fork()
    if pid == 0:
        child_save(engine, where, fault_at, report, tag)
    _, status = os.waitpid(pid, 0)
    return status


def main(out: Path, points: int, seed: int) -> None:
    torch.set_num_threads(1)
    engine = init_engine(make_model(), CONFIG)
    train_engine(engine, BATCHES[:2], 0, 1)
    base = out / "base"
    engine.save_checkpoint(base)
    engine.wait_for_checkpoint()  # asynchronous: publish the base before forking
    step2 = snapshot(engine)
    status = fork_save(engine, out / "dry", None, out / "dry.pt")
    if status != 0:
        raise AssertionError(f"the dry-run save failed (status {status})")
    dry = torch.load(out / "dry.pt", weights_only=True)
    labels, step3 = list(dry["events"]), dry["params"]
    events = len(labels)
    # Every event that is not a data write (open, fsync, rename, mkdir, remove: the protocol's
    # steps), plus `points` random writes (a file cut anywhere in its bytes).
    structural = {i + 1 for i, label in enumerate(labels) if label != "write"}
    writes = sorted(set(range(1, events + 1)) - structural)
    rng = random.Random(seed)
    chosen = sorted(structural | set(rng.sample(writes, min(points, len(writes)))))
    outcome = {"global_step2": 0, "global_step3": 0}
    for k in chosen:
        trial = out / f"kill{k}"
        shutil.copytree(base, trial)
        status = fork_save(engine, trial, k)
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            raise AssertionError(f"point {k}: the child was not killed (status {status})")
        fresh = init_engine(make_model(seed=5), CONFIG)
        path, _ = fresh.load_checkpoint(trial, load_rng_state=True)
        tag = Path(str(path)).name
        if tag == "global_step2":
            if not same(snapshot(fresh), step2):
                raise AssertionError(f"point {k}: global_step2 loaded with other weights")
            train_engine(fresh, BATCHES[2:3], 0, 1)
            if not same(snapshot(fresh), step3):
                raise AssertionError(f"point {k}: resuming from global_step2 does not reproduce step 3")
        elif tag == "global_step3" or tag == ".global_step3.old":
            if not same(snapshot(fresh), step3):
                raise AssertionError(f"point {k}: global_step3 loaded with other weights")
        else:
            raise AssertionError(f"point {k}: loaded {path}")
        try:  # the interrupted tag itself: complete, or refused (never half-loaded)
            init_engine(make_model(seed=6), CONFIG).load_checkpoint(trial, tag="global_step3")
        except CheckpointError:
            pass
        outcome["global_step3" if "global_step3" in tag else "global_step2"] += 1
        print(f"POINT {k}/{events}: killed, latest loads {tag}", flush=True)
        shutil.rmtree(trial)
    print(f"FAULT OK {len(chosen)} kill points ({len(structural)} protocol steps, {len(chosen) - len(structural)} "
          f"random writes) of {events} file events: previous checkpoint loaded "
          f"{outcome['global_step2']} times, the new one {outcome['global_step3']} times", flush=True)

    resave(engine, base, out, step2, step3)


def resave(engine: Any, base: Path, out: Path, step2: list[torch.Tensor], step3: list[torch.Tensor]) -> None:
    """Re-save the tag `latest` names (tag="global_step2" again, with step-3 weights), killed
    at every protocol step: the old or the new contents load, never neither."""
    fork_save(engine, out / "dry2", None, out / "dry2.pt", tag="global_step2")
    labels = list(torch.load(out / "dry2.pt", weights_only=True)["events"])
    points = [i + 1 for i, label in enumerate(labels) if label != "write"]
    old = new = 0
    for k in points:
        trial = out / f"resave{k}"
        shutil.copytree(base, trial)
        status = fork_save(engine, trial, k, tag="global_step2")
        if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
            raise AssertionError(f"re-save point {k}: the child was not killed (status {status})")
        fresh = init_engine(make_model(seed=5), CONFIG)
        fresh.load_checkpoint(trial)
        got = snapshot(fresh)
        if same(got, step2):
            old += 1
        elif same(got, step3):
            new += 1
        else:
            raise AssertionError(f"re-save point {k}: latest loads neither the old nor the new weights")
        shutil.rmtree(trial)
    print(f"RESAVE OK {len(points)} kill points re-saving the tag `latest` names: old contents loaded "
          f"{old} times, new {new} times", flush=True)

if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))  # sys.argv[4] == "async": see ASYNC
