"""Launch-test worker: an MoE checkpoint saved at 2 ranks with ep_size 2 resumes at 1 rank with
ep_size 1 (another world size and expert layout, ZeRO 2 -> 1) and continues as the uninterrupted
run (the same maths as tests/dist/test_moe.py, whose model, data and oracle it uses).

    moe_world_change.py save DIR     (torchrun, 2 ranks)
    moe_world_change.py load DIR     (plain python, 1 rank)

The 1-rank run takes both ranks' micro-batches as its accumulation steps (each micro-batch's
capacity and l_aux are its own, so the step is the 2-rank step). Prints "MOE WORLD OK ..." with
the deviations; raises on a deviation over the test file's tolerance.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dist"))

import test_moe as T

import zeroshard

CASE = T.CASES["top1_drop_clip"]
SAVED_STEPS = 2


def save(root: Path) -> None:
    groups = zeroshard.init_distributed()
    engine = T.make_engine(T.new_reference(CASE), CASE, 2, 2, groups.rank)
    T.train_engine(engine, T.batches(2), groups.rank, range(SAVED_STEPS))
    engine.save_checkpoint(root, tag="w2")
    print("MOE WORLD SAVED", flush=True)


def load(root: Path) -> None:
    zeroshard.init_distributed()
    torch.set_num_threads(1)
    data = T.batches(2)  # the 2-rank run's data (batches reads T.GAS)
    T.GAS = 2 * T.GAS  # read by T.config: one rank takes both ranks' micro-batches
    fresh = T.make_engine(T.new_reference(CASE, seed=7), CASE, 1, 1, 0)
    T.GAS //= 2
    fresh.load_checkpoint(root, tag="w2")
    reference = T.new_reference(CASE)
    want = T.train_oracle(reference, data, 2, CASE["clip"], 1, 1)
    worst = 0.0
    for step in range(SAVED_STEPS, T.STEPS):
        total = 0.0
        for micro in range(T.GAS):
            for rank in range(2):
                x, y = data[step][micro][rank]
                torch.manual_seed(T.draw_seed(step, micro, rank))
                loss = fresh(x, y)
                fresh.backward(loss)
                fresh.step()
                total += loss.item() / (2 * T.GAS)
        expect = sum(want[step]) / 2
        worst = max(worst, abs(total - expect) / abs(expect))
        if worst > T.RTOL:
            raise AssertionError(f"step {step}: loss {total}, uninterrupted 2-rank run {expect}")
    T.check_weights(fresh, reference, 0, 1, "resumed at 1 rank, ep 1")
    print(f"MOE WORLD OK 2 ranks ep 2 ZeRO-2 -> 1 rank ep 1 ZeRO-1: max relative |dloss| {worst:.1e}", flush=True)


if __name__ == "__main__":
    {"save": save, "load": load}[sys.argv[1]](Path(sys.argv[2]))
