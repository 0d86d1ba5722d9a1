"""ZenFlow's overlapped CPU step (`zero_optimization.zenflow.overlap_step`): the CPU AdamW of one
CPU step runs on a background thread while the next steps train, and its result reaches the
model's values at the next CPU step. Imports torch and zenflow_state.py; the thread runs no
collective (the ranks' collectives stay on the main thread, in the same order on every rank).

Note: [zenflow overlap] Read from DeepSpeed 0.19.8: runtime/zenflow/zenflow_stage_1_and_2.py
(ZenFlowZeroOptimizerParallel: get_overlap_step_state 669-676, wait_last_update_and_copy
710-755, zenflow_cpu_optimizer_step 757-776, step 778-828), runtime/zenflow/zenflow_utils.py
(start_optimizer_process 289-341, zenflow_optimizer_process 261-286) and
ops/csrc/adam/cpu_adam_impl.cpp (ZenFlowAdam::run_step, the control block). With the symbols of
Note: [zenflow rule] in zenflow.py, the overlapped run differs from the sequential one only in
the CPU step, at each step k where the rule has one:
1. If a CPU step is in flight, wait for it and cast its result (the fp32 master right after it:
   DeepSpeed's `stale_param` snapshot) into the model's values except the selected elements,
   which keep theirs (DeepSpeed: wait_last_update_and_copy, then the selective step restores the
   values temp_copy_param saved).
2. Start this step's CPU step on the master: AdamW (decoupled weight decay whatever the
   configured Adam / AdamW: DeepSpeed's process creates its CPU Adam with adamw_mode true,
   zenflow_utils.py:326), step count k + 1, on the accumulated gradient (clipped as without
   overlap, Note: [zenflow clip]), the hyper-parameters the groups hold now. Its moments are one
   of two sets, each zeros at the start (the process allocates exp_avg0/1, exp_avg_sq0/1), chosen
   by s(k): k & 1 during the warm-up, (k // U) & 1 after it, and with update_interval "auto"
   (k + 1) & 1 (DeepSpeed's zenflow_state, flipped at every backward from 0).
3. During the warm-up (k < W) wait for it at once and cast it into the whole model (no element
   is selected yet): warm-up steps are synchronous, as DeepSpeed waits right after submitting.
So the master runs ahead of the model by one CPU step; after the warm-up the model's values
hold the CPU step of the previous CPU-step boundary, and the last CPU step of a run never
reaches them (DeepSpeed neither drains nor stops its process at the end).
At a reselection (k > 0) the master is refreshed from the model's values; zeroshard first waits
for the step in flight (DeepSpeed does not, so a slow process races with that copy) and keeps
its result pending: the next CPU step casts it into the model, and the refreshed master steps
on without it, the numbers DeepSpeed gets when its process finishes before the next backward.
DeepSpeed with full_warm_up_rounds 0 skips its first two waits (no process yet at the first
boundary; the first-round flag at the second), so its semaphore runs one completion ahead and
every later wait returns at once; zeroshard waits at every boundary (the lag is always one CPU
step, as the first-round flag intends). Checkpoints wait for the step in flight and save its
result as pending, with both moment sets (DeepSpeed saves neither: its moments live in the
process); a resumed run is the uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor
from torch.optim.adamw import adamw

from zeroshard.zero.offload.zenflow_state import CPU_MOMENTS, PENDING, ZenFlowPiece


class OverlappedCpuStep:
    """The CPU AdamW of Note: [zenflow overlap] on a worker thread, its two moment sets and the
    finished step's master values waiting to reach the model.

    Args:
        pieces: the shard's fragments (their `master` is what the thread steps).
    """

    def __init__(self, pieces: Sequence[ZenFlowPiece]) -> None:
        self._masters = [p.master for p in pieces]
        self._moments = [[torch.zeros_like(p.master, dtype=torch.float32) for _ in CPU_MOMENTS] for p in pieces]
        """Per piece: exp_avg of sets 0 and 1, then exp_avg_sq of sets 0 and 1 (1-D fp32)."""
        self._pending: list[Tensor] | None = None
        """The finished step's master values (1-D fp32 per piece), not yet in the model's values."""
        self._future: Future[list[Tensor]] | None = None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def state_bytes(self) -> int:
        tensors = [t for m in self._moments for t in m] + list(self._pending or [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def wait(self) -> None:
        """Finish the step in flight, if any; its result stays pending. Before anything reads or
        writes the masters (a reselection, a checkpoint, a load)."""
        if self._future is not None:
            future, self._future = self._future, None
            self._pending = future.result()  # re-raises the thread's error here

    def take(self) -> list[Tensor] | None:
        """Wait, then hand over the pending master values (None: nothing to cast)."""
        self.wait()
        pending, self._pending = self._pending, None
        return pending

    def submit(self, k: int, grads: Sequence[Tensor], groups: Sequence[Mapping[str, Any]], moment_set: int) -> None:
        """Start step k's CPU AdamW on the masters with `grads` (owned by the thread from now)."""
        if self._future is not None or self._pending is not None:
            raise AssertionError("expected the previous CPU step applied before the next is started")
        hyper = [(float(g["lr"]), *map(float, g["betas"]), float(g["eps"]), float(g["weight_decay"])) for g in groups]
        moments = [(m[moment_set], m[2 + moment_set]) for m in self._moments]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zenflow-cpu-step")
        self._future = self._pool.submit(_adamw_steps, self._masters, list(grads), moments, hyper, k)

    def export(self, i: int) -> dict[str, Tensor]:
        """Piece i's state for a checkpoint (call `wait` first)."""
        out = dict(zip(CPU_MOMENTS, self._moments[i]))
        if self._pending is not None:
            out[PENDING] = self._pending[i]
        return out

    def load(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Each piece's loaded state (`export`'s keys), in piece order."""
        self.wait()
        for moments, state in zip(self._moments, states):
            for t, key in zip(moments, CPU_MOMENTS):
                t.copy_(state[key].reshape(-1))
        pending = [s.get(PENDING) for s in states]
        have = sum(p is not None for p in pending)
        if have not in (0, len(states)):
            raise AssertionError(f"expected a pending CPU step for every piece or none, got {have} of {len(states)}")
        self._pending = [p.reshape(-1).to(torch.float32).clone() for p in pending] if have else None


def _adamw_steps(masters: Sequence[Tensor], grads: Sequence[Tensor], moments: Sequence[tuple[Tensor, Tensor]],
                 hyper: Sequence[tuple[float, float, float, float, float]], k: int) -> list[Tensor]:
    """The worker thread's body: AdamW with step count k + 1 on each master; returns the masters'
    values right after it (DeepSpeed's stale snapshot)."""
    with torch.no_grad():  # grad mode is per thread: the main thread's no_grad does not reach here
        for master, grad, (exp_avg, exp_avg_sq), (lr, beta1, beta2, eps, wd) in zip(masters, grads, moments, hyper):
            adamw([master], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(k))], foreach=False,
                  amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=wd, eps=eps, maximize=False)
        return [m.detach().clone() for m in masters]
