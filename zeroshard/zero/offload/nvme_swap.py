"""Adam/AdamW whose fp32 master, exp_avg and exp_avg_sq live in swap files (ZeRO-Infinity's
optimizer offload to NVMe), stepped a sub-group at a time through a bounded buffer pool.

Note: [swap pipeline] The shard's `numel` elements are cut into sub-groups of at most
`sub_group_numel`. The host buffers are `slots` slots (`offload_optimizer.buffer_count`, at least
3, at most the number of sub-groups) of three page-aligned buffers each (`slots x 3 x
sub_group_numel x 4` bytes of host memory, whatever the shard's size). While sub-group k is
stepped by torch's fused Adam(W) CPU kernel, the next sub-groups are read into every slot whose
write-back has finished and the stepped ones are written back. Two things cut the disk traffic
and hide what is left behind the forward and backward passes:
- the last `slots` sub-groups stepped stay in their slots ("resident", not written) and are
  stepped first at the next step, so a step reads and writes `slots` sub-groups fewer;
- a step returns without waiting for its last write-backs: they finish while the next forward
  and backward run, and a slot is reused only once its write is done. Anything that reads or
  writes the files directly (checkpoints, loads) first flushes (`sync`).
The kernel is elementwise, so stepping a range in any order gives the bits the whole-tensor step
gives (tests/unit/test_nvme_swap.py checks it against torch.optim.AdamW(fused=True)).

Note: [swap files are scratch] Files live in `<nvme_path>/zeroshard-swap/<run>/rank<r>/`, with
`<run>` unique per process (host, pid, time). A run directory whose owning process is gone
(killed mid-step) is removed when the next run starts: it is never read as state. The states
are written to checkpoints in the normal format by whoever owns the shard; a resumed run builds
new swap files from them. `close()` (and interpreter exit) removes this run's files.

Imports nothing of ours but zero/offload/nvme_io.py.
"""

from __future__ import annotations

import atexit
import bisect
import itertools
import os
import shutil
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from zeroshard.zero.offload.nvme_io import AsyncIO, IOHandle, IOOptions, SwapFile, aligned_empty

STATES = ("master", "exp_avg", "exp_avg_sq")
_CUT = 64
"""Sub-groups cut a fragment only at multiples of this many elements from its start (Note: [swap pipeline])."""
_MIN_SLOTS = 3  # read-ahead, stepping, write-behind
SWAP_DIR = "zeroshard-swap"


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamHyper:
    """One parameter group's Adam(W) settings, as torch.optim.AdamW keeps them."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = True  # AdamW; False: Adam's L2 weight decay


def swap_bytes(numel: int) -> int:
    """Disk bytes the swap files of an `numel`-element shard take (three fp32 states, aligned)."""
    return 3 * (-(-numel * 4 // 4096) * 4096)


def sub_groups(fragments: Sequence[int], max_numel: int) -> list[list[tuple[int, int]]]:
    """Sub-groups of at most `max_numel` (a multiple of `_CUT`) elements over consecutive
    fragments of the given lengths: each a list of (start, end) pieces, one per fragment it
    touches. A fragment is cut only at multiples of `_CUT` from its own start, so every piece but
    a fragment's last is a whole number of SIMD vectors and each element takes the kernel path
    (vector body or scalar tail) it takes when its fragment is stepped whole."""
    groups: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    room, offset = max_numel, 0
    for length in fragments:
        start, end = offset, offset + length
        while start < end:
            take = end - start if end - start <= room else room // _CUT * _CUT
            if take == 0:  # too little room left for a whole cut: close the group
                groups.append(current)
                current, room = [], max_numel
                continue
            current.append((start, start + take))
            start, room = start + take, room - take
            if room == 0:
                groups.append(current)
                current, room = [], max_numel
        offset = end
    if current:
        groups.append(current)
    return groups


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_runs(root: Path) -> list[Path]:
    """Remove run directories under `root/zeroshard-swap` whose owning process on this host is
    gone (Note: [swap files are scratch]); returns what was removed."""
    removed = []
    host = socket.gethostname()
    for run in sorted((root / SWAP_DIR).glob("*")):
        owner = run / "owner"
        try:
            owner_host, pid = owner.read_text().split()
        except (OSError, ValueError):
            owner_host, pid = host, "0"  # no readable owner: a run that died while starting
        if owner_host == host and not _pid_alive(int(pid)):
            shutil.rmtree(run, ignore_errors=True)
            removed.append(run)
    return removed


def new_run_dir(root: Path, rank: int) -> Path:
    """`root/zeroshard-swap/<host>-<pid>-<time>-<uuid>/rank<rank>`, created, with an owner file."""
    remove_stale_runs(root)
    host = socket.gethostname()
    run = root / SWAP_DIR / f"{host}-{os.getpid()}-{int(time.time())}-{uuid.uuid4().hex[:8]}"
    run.mkdir(parents=True)
    (run / "owner").write_text(f"{host} {os.getpid()}\n")
    d = run / f"rank{rank}"
    d.mkdir()
    return d


class SwappedAdam:
    """The Adam(W) states of one rank's `numel`-element fp32 shard, in three swap files.

    Args:
        root: `nvme_path` (checked beforehand with `nvme_io.check_swap_dir`).
        numel: elements of the shard.
        rank: this rank, for the file names.
        sub_group_numel: elements stepped per sub-group (`sub_group_size`).
        io: block size, depth and threads (`aio`).
        fragments: lengths of the consecutive pieces the optimizer sees as separate parameters
            (the shard's fragments), so the step's bits match stepping each whole (default: one).
        fast_init: the states start as zeros from the files' reserved (unwritten, zero-reading)
            blocks instead of being written (`offload_optimizer.fast_init`).
    """

    def __init__(self, root: Path, numel: int, *, rank: int, sub_group_numel: int,
                 fragments: Sequence[int] | None = None, io: IOOptions = IOOptions(),
                 fast_init: bool = True, buffer_count: int = _MIN_SLOTS) -> None:
        self.numel = numel
        self.sub_group_numel = max(_CUT, min(sub_group_numel, max(numel, 1)) // _CUT * _CUT)
        fragments = list(fragments) if fragments is not None else [numel]
        if sum(fragments) != numel:
            raise ValueError(f"fragment lengths sum to {sum(fragments)}, not the shard's {numel} elements")
        self._groups_cache = sub_groups(fragments, self.sub_group_numel)
        self._fragments = fragments
        self._starts = [0, *itertools.accumulate(fragments)][:-1]
        self.dir = new_run_dir(Path(root), rank)
        self._io = AsyncIO(self.dir, io)
        self._files: dict[str, SwapFile] = {s: self._io.open(f"{s}.swp", numel * 4) for s in STATES}
        n_slots = max(1, min(max(_MIN_SLOTS, buffer_count), len(self._groups_cache)))
        self._slots = [{s: aligned_empty(self.sub_group_numel, torch.float32) for s in STATES}
                       for _ in range(n_slots)]
        self._slot_group: list[int | None] = [None] * n_slots  # the sub-group each slot holds
        self._slot_dirty = [False] * n_slots  # holds values newer than the files'
        self._slot_io: list[list[IOHandle]] = [[] for _ in range(n_slots)]  # requests in flight
        self._step = torch.zeros((), dtype=torch.float32)
        if not fast_init:
            for s in ("exp_avg", "exp_avg_sq"):
                self.write_state(s, torch.zeros(numel))
        atexit.register(self.close)

    @property
    def buffer_bytes(self) -> int:
        return len(self._slots) * len(STATES) * self.sub_group_numel * 4

    @property
    def step_count(self) -> int:
        return int(self._step.item())

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._step.fill_(value)

    def _groups(self) -> list[tuple[int, int]]:
        return [(pieces[0][0], pieces[-1][1]) for pieces in self._groups_cache]

    # -- whole-state transfers (initialisation, checkpoints) -------------------------------------

    def write_state(self, name: str, values: Tensor) -> None:
        """Write a whole state (`numel` fp32 values, e.g. the master from the model's weights or
        a checkpoint), a sub-group at a time through the pool."""
        self._stream(name, values.reshape(-1), write=True)

    def read_state(self, name: str, out: Tensor | None = None) -> Tensor:
        """A whole state read back (for checkpoints), into `out` or a new CPU tensor."""
        out = torch.empty(self.numel, dtype=torch.float32) if out is None else out
        self._stream(name, out.reshape(-1), write=False)
        return out

    def _stream(self, name: str, values: Tensor, *, write: bool) -> None:
        if values.numel() != self.numel:
            raise ValueError(f"{name}: expected {self.numel} elements, got {values.numel()}")
        self.sync(invalidate=True)
        n_slots = len(self._slots)
        pending: list[IOHandle | None] = [None] * n_slots
        for k, (s, e) in enumerate(self._groups()):
            slot = k % n_slots
            if pending[slot] is not None:
                pending[slot].wait()  # type: ignore[union-attr]
                if not write:
                    ps, pe = self._groups()[k - n_slots]
                    values[ps:pe].copy_(self._slots[slot][name][: pe - ps])
            buf = self._slots[slot][name][: e - s]
            if write:
                buf.copy_(values[s:e])
                pending[slot] = self._files[name].write(buf, s * 4)
            else:
                pending[slot] = self._files[name].read(buf, s * 4)
        groups = self._groups()
        for k in range(max(0, len(groups) - n_slots), len(groups)):
            h = pending[k % n_slots]
            if h is not None:
                h.wait()
            if not write:
                s, e = groups[k]
                values[s:e].copy_(self._slots[k % n_slots][name][: e - s])

    # -- the step -------------------------------------------------------------------------------

    def sync(self, *, invalidate: bool = False) -> None:
        """Finish every request in flight and write resident sub-groups newer than the files
        (Note: [swap pipeline]); with `invalidate`, also forget them (the files are about to be
        written by someone else)."""
        for i in range(len(self._slots)):
            self._wait_slot(i)
            if self._slot_dirty[i]:
                self._slot_io[i] = self._write(i)
                self._slot_dirty[i] = False
        for i in range(len(self._slots)):
            self._wait_slot(i)
            if invalidate:
                self._slot_group[i] = None

    def _wait_slot(self, i: int) -> None:
        handles, self._slot_io[i] = self._slot_io[i], []
        for h in handles:
            h.wait()

    def _read(self, i: int) -> list[IOHandle]:
        s, e = self._groups()[self._slot_group[i]]  # type: ignore[index]
        slot = self._slots[i]
        return [self._files[n].read(slot[n][: e - s], s * 4) for n in STATES]

    def _write(self, i: int) -> list[IOHandle]:
        s, e = self._groups()[self._slot_group[i]]  # type: ignore[index]
        slot = self._slots[i]
        return [self._files[n].write(slot[n][: e - s], s * 4) for n in STATES]

    @torch.no_grad()
    def step(self, grad: Tensor, hyper: AdamHyper, lp_out: Tensor | None = None) -> None:
        """One Adam(W) step of the whole shard with the flat gradient `grad` (`numel` values)."""
        grads = list(grad.split(self._fragments))
        outs = list(lp_out.split(self._fragments)) if lp_out is not None else None
        self.step_fragments(grads, [hyper] * len(grads), outs)

    @torch.no_grad()
    def step_fragments(self, grads: Sequence[Tensor], hypers: Sequence[AdamHyper],
                       outs: Sequence[Tensor] | None = None) -> None:
        """One Adam(W) step: fragment i has gradient `grads[i]` (CPU) and settings `hypers[i]`;
        Note: [swap pipeline]. `outs[i]`, when given, receives fragment i's updated master (cast
        to its dtype and device) as each sub-group finishes, so the weights need no second pass.
        Returns with the last write-backs still in flight."""
        n, n_slots = len(self._groups()), len(self._slots)
        self._step += 1
        slot_of = {g: i for i, g in enumerate(self._slot_group) if g is not None}
        order = [g for g in slot_of] + [g for g in range(n) if g not in slot_of]
        to_read = order[len(slot_of):]
        free = [i for i, g in enumerate(self._slot_group) if g is None]  # FIFO of reusable slots

        def issue(block: bool) -> None:
            # read ahead into free slots; a slot is reused only once its write-back is done
            while to_read and free and (block or all(h.done() for h in self._slot_io[free[0]])):
                i = free.pop(0)
                self._wait_slot(i)
                g = to_read.pop(0)
                self._slot_group[i], slot_of[g] = g, i
                self._slot_io[i] = self._read(i)
                block = False

        for pos, g in enumerate(order):
            issue(block=False)
            if g not in slot_of:
                issue(block=True)
            i = slot_of[g]
            self._wait_slot(i)  # its read (or, resident, nothing)
            self._step_group(i, g, grads, hypers, outs)
            if pos < n - n_slots:  # evicted later this step: write back now
                self._slot_io[i] = self._write(i)
                self._slot_dirty[i] = False
                free.append(i)
                del slot_of[g]
            else:  # stays resident for the next step
                self._slot_dirty[i] = True

    def _step_group(self, i: int, k: int, grads: Sequence[Tensor], hypers: Sequence[AdamHyper],
                    outs: Sequence[Tensor] | None) -> None:
        slot = self._slots[i]
        s = self._groups()[k][0]
        by_hyper: dict[AdamHyper, list[tuple[int, int, int]]] = {}
        for ps, pe in self._groups_cache[k]:
            i = bisect.bisect_right(self._starts, ps) - 1
            by_hyper.setdefault(hypers[i], []).append((i, ps, pe))
        for hyper, pieces in by_hyper.items():
            p, m, v = ([slot[n][ps - s : pe - s] for _, ps, pe in pieces] for n in STATES)
            g = [grads[i].reshape(-1)[ps - self._starts[i] : pe - self._starts[i]] for i, ps, pe in pieces]
            kernel = torch._fused_adamw_ if hyper.decoupled else torch._fused_adam_
            kernel(p, g, m, v, [], [self._step] * len(p), amsgrad=False, lr=hyper.lr,
                   beta1=hyper.betas[0], beta2=hyper.betas[1], weight_decay=hyper.weight_decay,
                   eps=hyper.eps, maximize=False)
            if outs is not None:
                for (i, ps, pe), new in zip(pieces, p):
                    outs[i].reshape(-1)[ps - self._starts[i] : pe - self._starts[i]].copy_(new)

    def fragment_state(self, name: str, index: int) -> Tensor:
        """Fragment `index`'s part of state `name`, read into a new CPU tensor (checkpoints)."""
        self.sync()
        start, n = self._starts[index], self._fragments[index]
        out = aligned_empty(n, torch.float32)
        self._files[name].read(out, start * 4).wait()
        return out

    def load_fragment_state(self, name: str, index: int, values: Tensor) -> None:
        """Write fragment `index`'s part of state `name` (a checkpoint's, or the master from weights)."""
        self.sync(invalidate=True)
        start = self._starts[index]
        src = aligned_empty(self._fragments[index], torch.float32)
        src.copy_(values.reshape(-1))
        self._files[name].write(src, start * 4).wait()

    def close(self) -> None:
        """Remove this run's swap files (Note: [swap files are scratch])."""
        if not self._files:
            return
        for i in range(len(self._slots)):
            try:
                self._wait_slot(i)  # nothing may still write into a file being removed
            except OSError:
                pass
        for f in self._files.values():
            f.remove()
        self._files = {}
        self._io.shutdown()
        shutil.rmtree(self.dir.parent, ignore_errors=True)
        atexit.unregister(self.close)
