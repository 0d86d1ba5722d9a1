"""The environment `zeroshard launch` forwards to workers: prefixed variables and env files.

Imports nothing of ours but `zeroshard.errors` (no torch). Which variables travel:

* from the launching shell, every variable whose name starts with one of `EXPORT_PREFIXES`
  (``NCCL_*``, ``PYTHON*`` such as ``PYTHONPATH``, ``ZEROSHARD_*``, ``UCX_*``, ``MV2_*``);
* every ``KEY=VALUE`` line of the user env files: ``.deepspeed_env`` and ``.zeroshard_env``
  in the home directory, then in the current directory (later files win), or only the file
  given by ``--env_file``.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from zeroshard.errors import LaunchError

__all__ = [
    "ENV_FILE_NAMES",
    "EXPORT_PREFIXES",
    "collect_exports",
    "default_env_files",
    "export_prefix",
    "parse_env_file",
    "parse_env_text",
]

EXPORT_PREFIXES: tuple[str, ...] = ("NCCL_", "PYTHON", "ZEROSHARD_", "UCX_", "MV2_")
"""Variables of the launching shell with these prefixes are exported to every node."""

ENV_FILE_NAMES: tuple[str, ...] = (".deepspeed_env", ".zeroshard_env")
"""Env file names searched in ``~`` and then ``.``; ``.deepspeed_env`` is DeepSpeed's name."""

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENV_FIX = "each line must read KEY=VALUE (blank lines and '#' comments are fine)"


def parse_env_text(text: str, source: str = "<env file>") -> dict[str, str]:
    """Parse env-file contents: ``KEY=VALUE`` lines, ``#`` comments, blank lines.

    An optional leading ``export`` is accepted, and one pair of matching quotes around the
    value is removed (``A="x y"`` sets ``A`` to ``x y``); nothing else is expanded.

    Raises:
        LaunchError: a line without ``=`` or with an invalid name, naming ``source`` and the
            line number.
    """
    env: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep:
            raise LaunchError(f"{source}:{lineno}: no '=' in {raw.strip()!r}; {_ENV_FIX}.")
        if not _KEY.match(key):
            raise LaunchError(
                f"{source}:{lineno}: {key!r} is not a variable name; {_ENV_FIX}."
            )
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key] = value
    return env


def parse_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read one env file; see `parse_env_text`.

    Raises:
        LaunchError: the file is missing or malformed.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise LaunchError(f"{p}: no such env file. Pass an existing file to --env_file.") from None
    except OSError as e:
        raise LaunchError(f"{p}: cannot read env file: {e.strerror}") from None
    return parse_env_text(text, source=str(p))


def default_env_files(cwd: Path | None = None, home: Path | None = None) -> list[Path]:
    """The env files that exist, in reading order: ``~`` before ``.``, DeepSpeed's name first."""
    cwd = Path.cwd() if cwd is None else cwd
    home = Path.home() if home is None else home
    found: list[Path] = []
    for directory in (home, cwd):
        for name in ENV_FILE_NAMES:
            path = directory / name
            if path.is_file() and path.resolve() not in [f.resolve() for f in found]:
                found.append(path)
    return found


def collect_exports(environ: Mapping[str, str], env_files: Sequence[Path]) -> dict[str, str]:
    """The variables to set on every node: prefixed ones from ``environ``, then the files'.

    Args:
        environ: the launching process's environment.
        env_files: env files read in order; a later file overrides an earlier one, and the
            files override the shell.
    """
    exports = {k: v for k, v in sorted(environ.items()) if k.startswith(EXPORT_PREFIXES)}
    for path in env_files:
        exports.update(parse_env_file(path))
    return exports


def export_prefix(exports: Mapping[str, str]) -> str:
    """``export K=V; `` for each variable, shell-quoted, for a remote shell command line."""
    return "".join(f"export {k}={shlex.quote(v)}; " for k, v in exports.items())
