"""The process torchrun starts for each worker of `zeroshard launch`: the script with `--local_rank=<i>`.

DeepSpeed's launcher passes every worker its local rank as an argument, `--local_rank=<i>` right
after the script, and scripts written for it read only that (DeepSpeed-Chat's step 1 decides
between one process and a process group on `args.local_rank`); torchrun gives the local rank in
`LOCAL_RANK` only. So `zeroshard launch` has torchrun start this module, which replaces itself
(exec) with the script's own command plus the argument: the worker is still the process torchrun
watches and signals, and nothing of zeroshard stays loaded in it. `--no_local_rank` (DeepSpeed's
flag) leaves this module out.

    python -u -m zeroshard.cli.launch_worker {python|module|exec} SCRIPT [ARGS...]

Imports nothing of ours.
"""

from __future__ import annotations

import os
import sys

MODES = ("python", "module", "exec")
"""How the script runs: `python -u SCRIPT`, `python -u -m MODULE`, or the executable itself."""


def worker_argv(mode: str, script: str, script_args: list[str], local_rank: str,
                python: str = sys.executable) -> list[str]:
    """The worker's command in DeepSpeed's order: interpreter, script, `--local_rank=<i>`, then
    the script's own arguments (a script that stops parsing at its first positional still sees it)."""
    head = {"python": [python, "-u"], "module": [python, "-u", "-m"], "exec": []}[mode]
    return [*head, script, f"--local_rank={local_rank}", *script_args]


def main(argv: list[str]) -> int:
    """Exec the worker's command; return 2 (with one line on stderr) when it cannot start."""
    if len(argv) < 2 or argv[0] not in MODES:
        print(f"zeroshard.cli.launch_worker: usage: {{{'|'.join(MODES)}}} SCRIPT [ARGS...]; got {argv}",
              file=sys.stderr)
        return 2
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        print("zeroshard.cli.launch_worker: LOCAL_RANK is not set; this module is started by torchrun "
              "(zeroshard launch), not by hand", file=sys.stderr)
        return 2
    cmd = worker_argv(argv[0], argv[1], argv[2:], local_rank)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(cmd[0], cmd)  # never returns on success
    except OSError as e:
        print(f"zeroshard.cli.launch_worker: cannot start {cmd[0]!r}: {e.strerror}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
