"""Adam states in swap files (zero/offload/nvme_swap.py): bitwise equal to torch's fused AdamW on CPU,
pipelined over sub-groups, and scratch files that never outlive their run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeroshard.zero.offload.nvme_io import IOOptions
from zeroshard.zero.offload.nvme_swap import SWAP_DIR, AdamHyper, SwappedAdam, remove_stale_runs, sub_groups, swap_bytes

IO = IOOptions(block_size=16384, queue_depth=2, thread_count=2)


def _reference(master: torch.Tensor, splits: list[int], grads: list[torch.Tensor], hyper: AdamHyper
               ) -> tuple[torch.Tensor, torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """CPU offload as the engine runs it: fragments (views of the master) in torch's fused AdamW."""
    frags = [torch.nn.Parameter(t) for t in master.split(splits)]
    cls = torch.optim.AdamW if hyper.decoupled else torch.optim.Adam
    opt = cls(frags, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay, fused=True)
    for g in grads:
        for f, gg in zip(frags, g.split(splits)):
            f.grad = gg.clone()
        opt.step()
    return master, opt, frags


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("numel,sub_group", [(50_000, 4096), (50_000, 10**9), (70_001, 5_000)])
def test_trajectory_bitwise_equal_to_fused_adamw(tmp_path: Path, decoupled: bool, numel: int,
                                                  sub_group: int) -> None:
    gen = torch.Generator().manual_seed(numel + sub_group)
    start = torch.randn(numel, generator=gen)
    grads = [torch.randn(numel, generator=gen) for _ in range(4)]
    hyper = AdamHyper(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, decoupled=decoupled)
    splits = [7, 12_000, numel - 7 - 12_000 - 999, 999]  # fragments that cut across sub-groups
    ref, opt, frags = _reference(start.clone(), splits, grads, hyper)

    swap = SwappedAdam(tmp_path, numel, rank=0, sub_group_numel=sub_group, fragments=splits, io=IO)
    swap.write_state("master", start)
    lp = torch.empty(numel, dtype=torch.bfloat16)
    for g in grads:
        swap.step(g, hyper, lp_out=lp)
    assert swap.step_count == 4
    assert torch.equal(swap.read_state("master"), ref)
    assert torch.equal(lp, ref.to(torch.bfloat16))
    exp_avg = torch.cat([opt.state[f]["exp_avg"] for f in frags])
    exp_avg_sq = torch.cat([opt.state[f]["exp_avg_sq"] for f in frags])
    assert torch.equal(swap.read_state("exp_avg"), exp_avg)
    assert torch.equal(swap.read_state("exp_avg_sq"), exp_avg_sq)
    swap.close()


def test_resume_from_states_continues_the_same_trajectory(tmp_path: Path) -> None:
    """A checkpoint's states written into fresh swap files step on exactly as before."""
    numel, hyper = 20_000, AdamHyper(lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    start, grads = torch.randn(numel, generator=gen), [torch.randn(numel, generator=gen) for _ in range(4)]
    a = SwappedAdam(tmp_path, numel, rank=0, sub_group_numel=3000, io=IO)
    a.write_state("master", start)
    for g in grads:
        a.step(g, hyper)
    b = SwappedAdam(tmp_path, numel, rank=0, sub_group_numel=7000, io=IO, fast_init=False)
    c = SwappedAdam(tmp_path, numel, rank=0, sub_group_numel=4096, io=IO)
    c.write_state("master", start)
    for g in grads[:2]:
        c.step(g, hyper)
    for name in ("master", "exp_avg", "exp_avg_sq"):
        b.write_state(name, c.read_state(name))
    b.step_count = c.step_count
    c.close()
    for g in grads[2:]:
        b.step(g, hyper)
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(a.read_state(name), b.read_state(name)), name
    a.close()
    b.close()


def test_fast_init_reads_zeros_and_slow_init_writes_them(tmp_path: Path) -> None:
    for fast in (True, False):
        s = SwappedAdam(tmp_path, 10_000, rank=1, sub_group_numel=4096, io=IO, fast_init=fast)
        assert torch.equal(s.read_state("exp_avg_sq"), torch.zeros(10_000))
        s.close()


def test_buffer_pool_is_bounded_by_the_sub_group(tmp_path: Path) -> None:
    s = SwappedAdam(tmp_path, 1_000_000, rank=0, sub_group_numel=10_000, io=IO)
    assert s.sub_group_numel == 9984 and s.buffer_bytes == 3 * 3 * 9984 * 4  # a whole number of 64-element cuts
    assert swap_bytes(1_000_000) == 3 * 4_001_792  # 4,000,000 bytes rounded up to 4 KiB
    assert sum(p.stat().st_size for p in s.dir.iterdir()) == swap_bytes(1_000_000)
    s.close()


def test_files_unique_per_run_and_rank_and_removed_at_close(tmp_path: Path) -> None:
    a = SwappedAdam(tmp_path, 5000, rank=0, sub_group_numel=4096, io=IO)
    b = SwappedAdam(tmp_path, 5000, rank=1, sub_group_numel=4096, io=IO)
    assert a.dir != b.dir and a.dir.name == "rank0" and b.dir.name == "rank1"
    assert (a.dir / "master.swp").exists()
    a.close()
    b.close()
    assert list((tmp_path / SWAP_DIR).iterdir()) == []


def test_stale_run_of_a_dead_process_is_replaced_never_read(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    pid = int(dead.stdout)
    stale = tmp_path / SWAP_DIR / "killed-run"
    (stale / "rank0").mkdir(parents=True)
    (stale / "owner").write_text(f"{socket.gethostname()} {pid}\n")
    (stale / "rank0" / "master.swp").write_bytes(b"\x7f" * 8192)  # garbage that must not be read
    alive = tmp_path / SWAP_DIR / "running-run"
    alive.mkdir()
    (alive / "owner").write_text(f"{socket.gethostname()} {os.getpid()}\n")

    s = SwappedAdam(tmp_path, 2048, rank=0, sub_group_numel=4096, io=IO)
    assert not stale.exists() and alive.exists()
    assert torch.equal(s.read_state("exp_avg"), torch.zeros(2048))
    s.close()
    assert remove_stale_runs(tmp_path) == []


def test_killed_process_leaves_files_the_next_run_removes(tmp_path: Path) -> None:
    code = (f"import os, torch; from zeroshard.zero.offload.nvme_swap import SwappedAdam; "
            f"s = SwappedAdam({str(tmp_path)!r}, 4096, rank=0, sub_group_numel=4096); os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})
    left = list((tmp_path / SWAP_DIR).iterdir())
    assert len(left) == 1  # os._exit skips cleanup, as a kill would
    SwappedAdam(tmp_path, 4096, rank=0, sub_group_numel=4096, io=IO).close()
    assert list((tmp_path / SWAP_DIR).iterdir()) == []


def test_sub_groups_cut_fragments_only_at_whole_vectors() -> None:
    groups = sub_groups([7, 300, 1000, 5], 256)
    flat = [p for g in groups for p in g]
    assert flat[0] == (0, 7) and flat[-1] == (1307, 1312)
    assert all(a[1] == b[0] for a, b in zip(flat, flat[1:]))  # contiguous, in order
    assert all(sum(e - s for s, e in g) <= 256 for g in groups)
    frag_starts = {0: 0, 7: 7, 307: 307, 1307: 1307}
    starts = sorted(frag_starts)
    for s, _ in flat:
        owner = max(x for x in starts if x <= s)
        assert (s - owner) % 64 == 0  # a cut inside a fragment is a whole number of vectors from its start
    with pytest.raises(ValueError, match="sum to 10, not the shard's 11"):
        SwappedAdam(Path("/nonexistent"), 11, rank=0, sub_group_numel=64, fragments=[4, 6])


def test_fragments_with_their_own_settings_and_checkpoint_access(tmp_path: Path) -> None:
    """Two parameter groups (decay / no decay) stepped as torch steps them; per-fragment state
    read and written for checkpoints."""
    gen = torch.Generator().manual_seed(3)
    splits = [3000, 130, 5000]
    start = torch.randn(sum(splits), generator=gen)
    grads = [torch.randn(sum(splits), generator=gen) for _ in range(3)]
    frags = [torch.nn.Parameter(t) for t in start.clone().split(splits)]
    opt = torch.optim.AdamW([{"params": [frags[0], frags[2]], "weight_decay": 0.1},
                             {"params": [frags[1]], "weight_decay": 0.0}], lr=1e-2, fused=True)
    hypers = [AdamHyper(lr=1e-2, weight_decay=wd) for wd in (0.1, 0.0, 0.1)]
    swap = SwappedAdam(tmp_path, sum(splits), rank=0, sub_group_numel=1024, fragments=splits, io=IO)
    swap.write_state("master", start)
    outs = [torch.empty(n) for n in splits]
    for g in grads:
        for f, gg in zip(frags, g.split(splits)):
            f.grad = gg.clone()
        opt.step()
        swap.step_fragments(list(g.split(splits)), hypers, outs)
    for i, f in enumerate(frags):
        assert torch.equal(outs[i], f.detach())
        assert torch.equal(swap.fragment_state("exp_avg_sq", i), opt.state[f]["exp_avg_sq"])
    swap.load_fragment_state("exp_avg", 1, torch.full((130,), 2.5))
    assert torch.equal(swap.fragment_state("exp_avg", 1), torch.full((130,), 2.5))
    assert torch.equal(swap.fragment_state("exp_avg", 2), opt.state[frags[2]]["exp_avg"])
    swap.close()


@pytest.mark.parametrize("buffer_count", [3, 5])
def test_resident_slots_and_write_behind_keep_the_trajectory(tmp_path: Path, buffer_count: int) -> None:
    """Note: [swap pipeline]: resident sub-groups skipped from the disk, write-backs left in flight
    across steps, and checkpoint-style reads and writes of the files between steps (which must
    see the resident values, then make the step re-read what they wrote) keep the bits of
    torch's fused AdamW."""
    numel, sub_group = 40_000, 4096  # 10 sub-groups: some resident, some swapped every step
    gen = torch.Generator().manual_seed(buffer_count)
    start = torch.randn(numel, generator=gen)
    grads = [torch.randn(numel, generator=gen) for _ in range(5)]
    hyper = AdamHyper(lr=1e-2, weight_decay=0.1)
    ref, opt, frags = _reference(start.clone(), [numel], grads[:3], hyper)
    swap = SwappedAdam(tmp_path, numel, rank=0, sub_group_numel=sub_group, io=IO, buffer_count=buffer_count)
    assert len(swap._slots) == buffer_count
    swap.write_state("master", start)
    for g in grads[:3]:
        swap.step(g, hyper)
    # the files alone (after a flush) hold the reference states
    assert torch.equal(swap.fragment_state("master", 0), ref)
    assert torch.equal(swap.fragment_state("exp_avg", 0), opt.state[frags[0]]["exp_avg"])
    # a write to the files between steps (a checkpoint load) replaces resident values
    moved = ref + 1.0
    swap.load_fragment_state("master", 0, moved)
    with torch.no_grad():
        frags[0].copy_(moved)
    for g in grads[3:]:
        frags[0].grad = g.clone()
        opt.step()
        swap.step(g, hyper)
    assert torch.equal(swap.read_state("master"), frags[0].detach())
    assert torch.equal(swap.read_state("exp_avg_sq"), opt.state[frags[0]]["exp_avg_sq"])
    swap.close()


def test_a_step_swaps_only_what_the_slots_cannot_keep(tmp_path: Path) -> None:
    """After the first step, the `slots` sub-groups stepped last stay in memory: a step reads and
    writes the other sub-groups only; with as many slots as sub-groups, nothing is swapped."""
    calls = {"read": 0, "write": 0}

    def counting(swap: SwappedAdam) -> None:
        for f in swap._files.values():
            for kind in ("read", "write"):
                inner = getattr(f, kind)

                def wrapped(*a, _inner=inner, _kind=kind, **k):
                    calls[_kind] += 1
                    return _inner(*a, **k)
                setattr(f, kind, wrapped)

    for slots, expect in ((4, 10 - 4), (10, 0)):
        swap = SwappedAdam(tmp_path, 10 * 1024, rank=0, sub_group_numel=1024, io=IO, buffer_count=slots)
        swap.step(torch.ones(10 * 1024), AdamHyper(lr=1e-3))  # first step: every sub-group read
        counting(swap)
        calls.update(read=0, write=0)
        swap.step(torch.ones(10 * 1024), AdamHyper(lr=1e-3))
        assert calls == {"read": 3 * expect, "write": 3 * expect}, slots  # three states per sub-group
        swap.close()
