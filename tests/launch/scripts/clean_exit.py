"""Run a user script that trains two steps and simply returns, JOBS times, two ranks each.

torch and zeroshard are imported once; each rank is a fork that runs the user's code at module
level and then falls off the end of this file, so it goes through the interpreter's real
teardown (threading shutdown, atexit, finalization) -- where a C++ thread left inside a c10d
call used to abort a finished rank ("terminate called without an active exception").
Prints one line per job with both exit statuses, then "CLEAN-EXIT <ok>/<jobs>".
"""

import atexit
import os
import shutil
import socket
import sys
import tempfile
import threading

import torch
import torch._dynamo  # see below

import zeroshard
from zeroshard.examples.gpt import GPT, GPTConfig

# What every rank's script imports on its way, imported once here so that the ranks start with it
# loaded instead of importing it again in each of the 60 forks (about 3 s of CPU each, most of a
# job): torch._dynamo, which torch.optim imports lazily when the first optimizer is built, and
# zeroshard.initialize's module. A rank's state at exit is the same: the same modules loaded, the
# same objects of its own.
zeroshard.initialize  # noqa: B018  the lazy attribute: imports zeroshard.runtime.initialize

JOBS = int(sys.argv[1]) if len(sys.argv) > 1 else 30
out_dir = tempfile.mkdtemp(prefix="zeroshard-clean-exit-")
rank = -1
for job in range(JOBS):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pids = []
    for r in range(2):
        pid = os.fork()
        if pid == 0:
            rank = r
            break
        pids.append(pid)
    if rank >= 0:
        break  # a child: run the user script below
    statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    logs = ""
    for r in range(2):
        with open(f"{out_dir}/{job}.{r}") as f:
            logs += f.read()
    aborted = "terminate called" in logs
    gone = logs.count("WATCHER-GONE-BEFORE-ATEXIT")
    ok = statuses == [0, 0] and not aborted and gone == 2
    print(f"job {job}: exit {statuses}, terminate message {aborted}, watcher stopped {gone}/2"
          + ("" if ok else f"\n{logs}"), flush=True)
    JOBS_OK = globals().get("JOBS_OK", 0) + ok

if rank < 0:
    print(f"CLEAN-EXIT {JOBS_OK}/{JOBS}", flush=True)
    shutil.rmtree(out_dir, ignore_errors=True)  # the ranks' logs, read above
else:
    # ---- the user's script (one rank) ----
    fd = os.open(f"{out_dir}/{job}.{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    def check_watcher() -> None:
        # Registered first, so atexit runs it last: by then the watcher must be gone.
        alive = [t.name for t in threading.enumerate() if t.name.startswith("zeroshard")]
        print("WATCHER-GONE-BEFORE-ATEXIT" if not alive else f"STILL ALIVE AT EXIT: {alive}",
              flush=True)

    atexit.register(check_watcher)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randint(0, 256, (2, 16))
    for _ in range(2):
        engine.backward(engine(x, x))
        engine.step()
    # ... and the script simply ends here.
