"""`zeroshard install-deepspeed-command`: a `deepspeed` launcher command that runs
`zeroshard launch --as_deepspeed`, for scripts and tools that call DeepSpeed's launcher by name
(DeepSpeed-Chat's `training_scripts/*.sh`, Accelerate's multi-node launch).

Not installed with the package: a `deepspeed` command would shadow a real DeepSpeed installed
beside zeroshard. This writes one into a directory on request (default: the directory of the
running Python, a virtual environment's `bin/`), refuses to overwrite a file it did not write, and
`--remove` takes its own file away again. Imports nothing of ours.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path

MARKER = "# written by `zeroshard install-deepspeed-command`"


def command_text(python: str) -> str:
    """The command file: a shell script that hands every argument to `zeroshard launch --as_deepspeed`."""
    return (f"#!/bin/sh\n{MARKER}: DeepSpeed's launcher served by zeroshard.\n"
            f"# Remove it with `zeroshard install-deepspeed-command --remove`.\n"
            f'exec "{python}" -m zeroshard.cli.main launch --as_deepspeed "$@"\n')


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="zeroshard install-deepspeed-command", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(sys.executable).parent,
                        help="where to write `deepspeed` (default: the running Python's directory)")
    parser.add_argument("--remove", action="store_true", help="remove a `deepspeed` command this wrote")
    args = parser.parse_args(argv)
    target = args.dir / "deepspeed"
    ours = target.is_file() and MARKER in target.read_text(errors="replace")
    if args.remove:
        if not target.exists():
            print(f"{target}: no such file; nothing to remove")
            return 0
        if not ours:
            print(f"{target}: not written by zeroshard (a real DeepSpeed's?); left as it is", file=sys.stderr)
            return 2
        target.unlink()
        print(f"removed {target}")
        return 0
    if target.exists() and not ours:
        print(f"{target}: already exists and was not written by zeroshard (a real DeepSpeed's launcher?); "
              "remove it yourself, or choose another --dir that comes first on PATH", file=sys.stderr)
        return 2
    if not args.dir.is_dir():
        print(f"--dir {args.dir}: not a directory", file=sys.stderr)
        return 2
    target.write_text(command_text(sys.executable))
    target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    path_dirs = [Path(p).resolve() for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    on_path = args.dir.resolve() in path_dirs
    print(f"wrote {target}: `deepspeed ARGS` now runs `zeroshard launch --as_deepspeed ARGS`"
          + ("" if on_path else f" ({args.dir} is not on PATH: add it, or call {target} by its path)"))
    return 0
