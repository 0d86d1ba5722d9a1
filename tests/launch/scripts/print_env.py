"""Launch test worker: prints the variables the launcher should have set (no torch import)."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    names = ["RANK", "WORLD_SIZE", "ZS_LAUNCH_TEST", "ZS_QUOTED"] + sys.argv[1:]
    print("ENV " + " ".join(f"{n}={os.environ.get(n, '<unset>')}" for n in names), flush=True)
