"""The pure pieces of zero/: execution order and prefetch policy (schedule.py), the stage-3 unit
plan (unit_plan.py), the offload policy (zero/offload/policy.py), the staging-pool arithmetic of the
estimator. No process group."""

from __future__ import annotations

import torch

from zeroshard.config import load_config
from zeroshard.estimate.states import _staging_pool
from zeroshard.zero.offload.policy import OffloadPolicy
from zeroshard.zero.schedule import ExecutionOrder, PrefetchPolicy, gathered_after_forward
from zeroshard.zero.unit_plan import plan_units


def test_order_records_once_then_replays_and_rerecords_on_change() -> None:
    order = ExecutionOrder()
    order.start_forward()
    for u in (0, 1, 2, 3):
        order.record(u)
    assert order.recording and order.order == [0, 1, 2, 3]
    order.finish_recording()
    order.start_forward()
    order.record(0)
    assert order.replaying and order.upcoming() == [1, 2, 3]
    assert order.before(2) == [1, 0]
    order.record(2)  # skipped unit 1: the order changed, record again from here
    assert order.recording and order.order == [0, 2]


def test_prefetch_respects_both_budgets_and_reuse_distance() -> None:
    order = ExecutionOrder()
    for u in (0, 1, 2, 3):
        order.record(u)
    order.finish_recording()
    order.start_forward()
    order.record(0)
    policy = PrefetchPolicy(order, [10, 10, 10, 10], prefetch_numel=25, max_live_numel=1000, max_reuse_distance=15)
    started: list[int] = []
    policy.prefetch_forward(lambda: 10 * len(started), started.append)
    assert started == [1, 2], "two units fit in a 25-element prefetch budget"
    started.clear()
    tight = PrefetchPolicy(order, [10, 10, 10, 10], prefetch_numel=25, max_live_numel=15, max_reuse_distance=15)
    tight.prefetch_forward(lambda: 10, started.append)
    assert started == [], "10 live + 10 more would pass max_live_numel"
    assert not policy.reused_soon(0), "unit 0 does not come back in this forward"
    released = {0: True, 1: False, 2: True, 3: True}
    started.clear()
    policy.prefetch_backward(3, lambda: 0, lambda u: released[u], started.append)
    # Unit 1 is already gathered: it is skipped but counts toward the 25-element budget (so
    # that a recompute's second call does not prefetch one unit further), leaving room for 2 only.
    assert started == [2], "backward gathers the released units before 3, nearest first, within budget"
    wide = PrefetchPolicy(order, [10, 10, 10, 10], prefetch_numel=35, max_live_numel=1000, max_reuse_distance=15)
    started.clear()
    wide.prefetch_backward(3, lambda: 0, lambda u: released[u], started.append)
    assert started == [2, 0]


def test_reuse_distance_counts_into_backward() -> None:
    # Units 0..3 of 10 elements, recorded in that order; backward reaches them as 3, 2, 1, 0.
    order = ExecutionOrder()
    for u in (0, 1, 2, 3):
        order.record(u)
    order.finish_recording()

    def kept(distance: int) -> list[bool]:
        policy = PrefetchPolicy(order, [10] * 4, prefetch_numel=0, max_live_numel=0, max_reuse_distance=distance)
        order.start_forward()
        out = []
        for u in (0, 1, 2, 3):
            order.record(u)
            out.append(policy.reused_soon(u))
        return out

    # After unit 2: unit 3 forward (10), unit 3 backward (20), then unit 2 itself.
    assert kept(25) == [False, False, True, True]
    assert kept(20) == [False, False, False, True], "the distance is exclusive, as DeepSpeed's"
    assert kept(10**9) == [True] * 4
    assert kept(0) == [False] * 4
    # The estimator's working set: root 0 finishes last (kept at distance 0); blocks 1..3 inside it.
    assert gathered_after_forward([10] * 4, 25) == 10 + 10 + 10
    assert gathered_after_forward([10] * 4, 10**9) == 40
    assert gathered_after_forward([10] * 4, 0) == 0


def test_unit_plan_puts_small_parameters_last_within_the_budget() -> None:
    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    root = torch.nn.Module()
    root.blocks, root.norm = blocks, torch.nn.LayerNorm(4)
    frozen = blocks[1].bias
    trainable = {id(p) for p in root.parameters() if p is not frozen}
    plan = plan_units(root, [root, *blocks], trainable, world_size=2, align=1,
                      persistence_threshold=5, persistence_budget=8)  # the two block biases, not the norm's
    assert plan.persistent == 3 and plan.unit_modules == [root, blocks[0], blocks[1], None]
    assert plan.names == ["norm.weight", "norm.bias", "blocks.0.weight", "blocks.1.weight",
                          "blocks.0.bias", "blocks.1.bias"]
    assert plan.unit_of == [0, 0, 1, 2, 3, 3]
    assert plan.trainable == [True, True, True, True, True, False]
    assert plan.partition.buckets == [(0, 2), (2, 3), (3, 4), (4, 6)]


def test_offload_policy_from_config() -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu"}}}, dp_world_size=1)
    opt = OffloadPolicy.from_config(cfg.zero_optimization.offload_optimizer)
    assert opt.offloaded and opt.pin_memory and opt.label(torch.device("cpu")) == "cpu (offload)"
    assert not OffloadPolicy().offloaded and OffloadPolicy().label(torch.device("cpu")) == "cpu"
    # Pinning only makes sense with an accelerator to copy to: never on a CPU-only model.
    assert not opt.pinned(torch.device("cpu"))
    t = opt.allocate(8, torch.float32, torch.device("cpu"))
    assert t.shape == (8,) and not t.is_pinned() and bool((t == 0).all())


def test_staging_pool_counts_blocks_by_size() -> None:
    assert _staging_pool((100, 100, 100, 100), overlap_comm=True) == 300
    assert _staging_pool((100, 100, 100, 100), overlap_comm=False) == 100
    assert _staging_pool((500, 100, 100, 100), overlap_comm=True) == 500 + 300
    assert _staging_pool((7,), overlap_comm=True) == 7
