"""How a rank waits for its peers on one host: spin a little, then sleep briefly, look now and
then whether they are still alive, and give up at a deadline.

The signature board's checks (board.py) and the shared-memory arena's phases (shm.py) both wait
this way; the loop lives here so that neither imports the other for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

LIVENESS_S = 0.2
"""How often a waiting rank looks whether the peers it waits for are still alive."""
_SPINS = 50
"""Yields a waiting thread makes before it starts sleeping."""
R = TypeVar("R")


def spin_wait(ready: Callable[[], R | None], deadline: float, check: Callable[[], BaseException | None],
              timeout: Callable[[float], BaseException]) -> R | BaseException:
    """Until ``ready()`` returns something, returned. Yields first (a peer is often microseconds
    behind), then sleeps a twentieth of the wait so far (20-500 us: latency stays small, wake-ups
    few); every ``LIVENESS_S`` ``check()`` may end it with an error (a peer gone); past
    ``deadline`` it ends with ``timeout(seconds waited)``. The board's checks and the arena's
    phases (shm.py) wait this way."""
    spins, started, next_check = 0, time.monotonic(), 0.0
    while True:
        result = ready()
        if result is not None:
            return result
        spins += 1
        if spins < _SPINS:
            time.sleep(0)
            continue
        now = time.monotonic()
        if now > deadline:
            return timeout(now - started)
        if now >= next_check:
            next_check = now + LIVENESS_S
            error = check()
            if error is not None:
                return error
        time.sleep(min(0.0005, max(0.00002, (now - started) / 20)))
