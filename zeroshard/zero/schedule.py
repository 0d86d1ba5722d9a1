"""Stage 3's execution order and its prefetch / reuse policy.

The order in which units run forward is recorded on the first training forward and replayed
after: the units after the current one are prefetched during forward, the units before it
during backward (which runs the order in reverse), within `stage3_prefetch_bucket_size` and
`stage3_max_live_parameters`; a unit used again within `stage3_max_reuse_distance` gathered
elements stays gathered. If a later forward runs another order, recording starts again from
where it diverged. Pure bookkeeping on unit indices and sizes: no tensors, no collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class ExecutionOrder:
    """The forward order of units, recorded once and checked on every later forward."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.recording = True
        self._pos = 0

    def start_forward(self) -> None:
        self._pos = 0

    def reset(self) -> None:
        """Forget the recorded order; the next training forward records it again."""
        self.order, self.recording, self._pos = [], True, 0

    def record(self, unit: int) -> None:
        """Unit `unit` runs forward now (training forwards only)."""
        if self.recording:
            self.order.append(unit)
        elif self._pos >= len(self.order) or self.order[self._pos] != unit:
            self.order, self.recording = self.order[: self._pos] + [unit], True  # the order changed
        self._pos += 1

    def finish_recording(self) -> None:
        """A backward completed: the recorded order is used from now on."""
        if self.recording and self.order:
            self.recording = False

    @property
    def replaying(self) -> bool:
        return not self.recording and bool(self.order)

    def upcoming(self) -> list[int]:
        """Units still to run forward in this pass, in order."""
        return self.order[self._pos :]

    def before(self, unit: int) -> list[int]:
        """Units before the last run of `unit`, nearest first (what backward reaches next)."""
        if unit not in self.order:
            return []
        position = len(self.order) - 1 - self.order[::-1].index(unit)
        return list(reversed(self.order[:position]))


class PrefetchPolicy:
    """Which units to gather ahead of use, and which to keep gathered after use.

    Args:
        order: the recorded execution order.
        unit_numel: gathered elements of each unit.
        prefetch_numel: elements gathered ahead at once (`stage3_prefetch_bucket_size`).
        max_live_numel: gathered elements at once, prefetch included (`stage3_max_live_parameters`).
        max_reuse_distance: keep a unit gathered if it is used again within this many gathered
            elements (`stage3_max_reuse_distance`).
    """

    def __init__(self, order: ExecutionOrder, unit_numel: Sequence[int], *, prefetch_numel: int,
                 max_live_numel: int, max_reuse_distance: int) -> None:
        self._order, self._numel = order, list(unit_numel)
        self._prefetch_numel, self._max_live = prefetch_numel, max_live_numel
        self._max_reuse = max_reuse_distance

    def prefetch_forward(self, live_numel: Callable[[], int], start_gather: Callable[[int], None]) -> None:
        """Start gathering the next units of forward while the budget allows."""
        if not self._order.replaying:
            return
        budget = self._prefetch_numel
        for nxt in self._order.upcoming():
            need = self._numel[nxt]
            if budget < need or live_numel() + need > self._max_live:
                break
            start_gather(nxt)
            budget -= need

    def prefetch_backward(self, unit: int, live_numel: Callable[[], int], is_released: Callable[[int], bool],
                          start_gather: Callable[[int], None]) -> None:
        """Backward reached `unit`: start gathering the released units before it."""
        if self._order.recording:
            return
        budget = self._prefetch_numel
        for prev in self._order.before(unit):
            need = self._numel[prev]
            if not is_released(prev):
                # Already gathered or in flight: part of what is ahead of use. (Without counting
                # it, a second call for the same unit, as the recompute of activation
                # checkpointing makes, prefetched one unit further each time.)
                budget -= need
                continue
            if budget < need or live_numel() + need > self._max_live:
                break
            start_gather(prev)
            budget -= need

    def reused_soon(self, unit: int) -> bool:
        """True if `unit`, whose forward just finished, runs again within `max_reuse_distance`
        gathered elements, counting the rest of this forward and then backward, which reaches
        the units in the reverse of the recorded order (DeepSpeed's reading of the setting: its
        trace spans both passes). The unit finishing when no forward is left (the root, or the
        last) is the first backward reaches, at distance 0. With the default distance (1e9) a
        model below that size keeps every unit gathered from its forward to its backward, and
        backward gathers nothing again."""
        if self._order.recording:
            return False
        upcoming = self._order.upcoming()
        if not upcoming:
            return self._max_reuse > 0
        distance = 0
        for nxt in [*upcoming, *reversed(self._order.order)]:
            if distance >= self._max_reuse:
                return False
            if nxt == unit:
                return True
            distance += self._numel[nxt]
        return False


def gathered_after_forward(unit_numel: Sequence[int], max_reuse_distance: int) -> int:
    """Elements still gathered when a training forward ends under ``PrefetchPolicy.reused_soon``,
    for units as stage 3 builds them: unit 0 the root, entered first and finished last, units
    ``1..n-1`` run inside it in order. What stage 3 holds at the turn from forward to backward
    besides prefetch (the memory estimator's working set)."""
    order = ExecutionOrder()
    for u in range(len(unit_numel)):
        order.record(u)
    order.finish_recording()
    policy = PrefetchPolicy(order, unit_numel, prefetch_numel=0, max_live_numel=0,
                            max_reuse_distance=max_reuse_distance)
    order.start_forward()
    kept = 0
    for u in range(len(unit_numel)):
        order.record(u)
        if u > 0 and policy.reused_soon(u):
            kept += unit_numel[u]
    return kept + (unit_numel[0] if unit_numel and policy.reused_soon(0) else 0)
