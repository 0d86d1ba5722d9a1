"""Cutting a list of layers into pipeline stages: DeepSpeed's methods and a balanced one.

Every function returns `parts`, a list of num_parts + 1 layer indices: stage s owns layers
[parts[s], parts[s + 1]). Pure arithmetic on Python numbers; imports nothing of ours.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """The same number of layers per stage; the first `num_items % num_parts` stages get one more.

    With fewer items than parts, stage s owns item s and the last stages are empty (DeepSpeed's
    result, kept for its boundaries).

    >>> partition_uniform(7, 3)
    [0, 3, 5, 7]
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    base, extra = divmod(num_items, num_parts)
    return [p * base + min(p, extra) for p in range(num_parts + 1)]


def partition_spread(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's `partition_balanced`: contiguous parts minimising (heaviest - lightest part).

    A dynamic programme over (first i items, j parts). Among cuts of equal cost the last one
    scanned wins, which fixes DeepSpeed's exact boundaries (tests/unit/test_pipe_partition.py
    compares them with the installed DeepSpeed). Parts are never empty when there are more
    items than parts; otherwise this is `partition_uniform`.
    """
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = math.inf
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    heaviest = [[inf] * (m + 1) for _ in range(n + 1)]
    lightest = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    cut = [[0] * (m + 1) for _ in range(n + 1)]
    heaviest[0][0] = cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi = max(heaviest[k][j - 1], part)
                lo = min(lightest[k][j - 1], part)
                c = hi - lo
                if cost[i][j] >= c:
                    cost[i][j], heaviest[i][j], lightest[i][j], cut[i][j] = c, hi, lo, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(cut[parts[-1]][j])
    return parts[::-1]


def partition_min_max(weights: Sequence[float], num_parts: int) -> list[int]:
    """zeroshard's balanced cut: contiguous, non-empty parts minimising the heaviest part.

    A pipeline runs at the pace of its slowest stage, so the bottleneck is what to minimise
    (DeepSpeed's objective, the spread, can accept a heavier bottleneck for a smaller spread).
    Ties go to the smaller spread, then to the earliest cut.

    Raises:
        ValueError: fewer layers than stages (a stage would be empty).
    """
    n, m = len(weights), num_parts
    if m < 1 or n < m:
        raise ValueError(
            f"the balanced partition needs at least one layer per stage: {n} layers, {m} stages. "
            "Use fewer stages (num_stages) or more layers")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    # best[j][i] = (heaviest, spread, cut) for the first i items in j parts
    inf = (math.inf, math.inf, 0)
    best = [[inf] * (n + 1) for _ in range(m + 1)]
    lows = [[math.inf] * (n + 1) for _ in range(m + 1)]
    best[0][0] = (0.0, 0.0, 0)
    for j in range(1, m + 1):
        for i in range(j, n - (m - j) + 1):
            for k in range(j - 1, i):
                if best[j - 1][k][0] == math.inf:
                    continue
                part = prefix[i] - prefix[k]
                hi = max(best[j - 1][k][0], part)
                lo = min(lows[j - 1][k], part) if j > 1 else part
                key = (hi, hi - lo, k)
                if key < best[j][i]:
                    best[j][i], lows[j][i] = key, lo
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(best[j][parts[-1]][2])
    return parts[::-1]
