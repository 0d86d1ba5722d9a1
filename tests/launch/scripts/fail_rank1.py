"""Launch test worker: rank 1 fails at once, rank 0 would wait two minutes (no torch import)."""

from __future__ import annotations

import os
import sys
import time

if __name__ == "__main__":
    if os.environ["RANK"] == "1":
        print("rank 1 failing on purpose", flush=True)
        sys.exit(3)
    time.sleep(120)
