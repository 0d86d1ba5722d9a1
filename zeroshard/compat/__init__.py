"""`import deepspeed` served by zeroshard, opt-in: the compatibility alias.

Hugging Face Transformers and Accelerate (and many scripts) have no hook for another engine:
they look for a package named `deepspeed` and call it. With the alias active, that package is
zeroshard's own tree under `zeroshard/compat/alias/deepspeed/`, each name mapped onto
zeroshard's code (no second implementation), and its distribution metadata reports
`DEEPSPEED_VERSION`, a DeepSpeed version those libraries accept.

It is active only when asked:
- `ZEROSHARD_AS_DEEPSPEED=1` in the environment (a `.pth` file installed with zeroshard calls
  `install()` at interpreter start-up, so torchrun workers and `accelerate launch` children
  inherit it),
- `zeroshard.compat.install()` in code, before anything imports `deepspeed`,
- `zeroshard launch --as-deepspeed ...` for every worker it starts.
With none of these, `import deepspeed` finds whatever is installed (a real DeepSpeed or nothing).
This module imports nothing heavy: the `.pth` hook must stay cheap.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV_VAR = "ZEROSHARD_AS_DEEPSPEED"
DEEPSPEED_VERSION = "0.19.8+zeroshard"
"""What `importlib.metadata.version("deepspeed")` and `deepspeed.__version__` report under the
alias: the DeepSpeed release whose behaviour zeroshard reproduces, with a local label that says
who serves it. transformers needs >= 0.9.3 and accelerate >= 0.16.4 (as of transformers 5.x
and accelerate 1.x); PEP 440 orders 0.19.8+zeroshard after 0.19.8."""

ALIAS_DIR = Path(__file__).resolve().parent / "alias"
"""Put first on sys.path: holds the `deepspeed` package and its `.dist-info` metadata."""


def requested(environ: "os._Environ[str] | dict[str, str]" = os.environ) -> bool:
    """True when the environment asks for the alias (ZEROSHARD_AS_DEEPSPEED set, not 0/false)."""
    return environ.get(ENV_VAR, "").strip().lower() not in ("", "0", "false", "no", "off")


def is_installed() -> bool:
    """True when `import deepspeed` resolves (or would resolve) to zeroshard's alias."""
    mod = sys.modules.get("deepspeed")
    if mod is not None:
        return bool(getattr(mod, "__served_by_zeroshard__", False))
    return str(ALIAS_DIR) in sys.path


def install() -> None:
    """Make `import deepspeed` (and `importlib.metadata` / `find_spec`) resolve to zeroshard.

    Call it before anything imports `deepspeed`. Idempotent. Also exports
    ZEROSHARD_AS_DEEPSPEED=1 so that child processes (launchers, dataloader workers) get the
    alias too.

    Raises:
        ImportError: a real `deepspeed` was already imported in this process; the alias cannot
            replace a module that code already holds. Install the alias earlier (set
            ZEROSHARD_AS_DEEPSPEED=1 before starting Python).
    """
    loaded = sys.modules.get("deepspeed")
    if loaded is not None and not getattr(loaded, "__served_by_zeroshard__", False):
        raise ImportError(
            f"zeroshard.compat.install(): a real deepspeed ({getattr(loaded, '__file__', '?')}) is "
            "already imported in this process; call install() before anything imports deepspeed, "
            f"or start Python with {ENV_VAR}=1.")
    path = str(ALIAS_DIR)
    if path not in sys.path:
        sys.path.insert(0, path)
    os.environ[ENV_VAR] = "1"
    import importlib

    importlib.invalidate_caches()


def _pth_hook() -> None:
    """Called by zeroshard_as_deepspeed.pth at interpreter start-up when ZEROSHARD_AS_DEEPSPEED is set."""
    if requested():
        try:
            install()
        except Exception as e:  # start-up must never break the interpreter
            print(f"[zeroshard] {ENV_VAR} is set but the deepspeed alias was not installed: {e}",
                  file=sys.stderr)
