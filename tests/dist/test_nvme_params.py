"""Stage-3 parameter shards on NVMe (`offload_param.device: "nvme"`, zero/offload/nvme_params.py) at 1/2/3 ranks.

- The trajectory is CPU parameter offload's, bit for bit (fp32 and bf16; with the optimizer on
  the CPU and on NVMe).
- At most `max_in_cpu` shard elements stay mapped in (beyond the unit in use), and every step
  pages the shards in again after the step wrote them back.
- Checkpoints hold the values (a resumed NVMe run equals the uninterrupted one; a CPU-offload
  run loads it); stale swap directories of dead processes are removed; the file goes at close.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import init_engine, make_config, make_model, train_engine
from test_zero12 import STEPS, run

from zeroshard.zero.offload.nvme_swap import SWAP_DIR

ROOT = Path(tempfile.gettempdir()) / "zeroshard-test-nvme-params"


def config(precision: str, params: str, optimizer: str = "cpu", max_in_cpu: int = 10**9) -> dict[str, Any]:
    extra: dict[str, Any] = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    ROOT.mkdir(exist_ok=True)
    zero: dict[str, Any] = {"stage": 3, "reduce_bucket_size": 300, "sub_group_size": 640,
                            "stage3_param_persistence_threshold": 100,
                            "offload_param": {"device": params}, "offload_optimizer": {"device": optimizer}}
    for section in ("offload_param", "offload_optimizer"):
        if zero[section]["device"] == "nvme":
            zero[section]["nvme_path"] = str(ROOT)
    zero["offload_param"]["max_in_cpu"] = max_in_cpu
    return make_config(gradient_accumulation_steps=2, gradient_clipping=0.05, zero_optimization=zero, **extra)


def home_of(engine: Any) -> Any:
    return engine._strategy._lp_home


@pytest.mark.parametrize("precision,optimizer", [("fp32", "cpu"), ("bf16", "cpu"), ("fp32", "nvme")])
def test_matches_cpu_param_offload_bitwise(groups, precision: str, optimizer: str) -> None:
    _, want = run(config(precision, "cpu", optimizer), groups.rank, groups.world_size)
    engine, got = run(config(precision, "nvme", optimizer), groups.rank, groups.world_size)
    for step in range(STEPS):
        for g, w in zip(got[step], want[step], strict=True):
            assert torch.equal(g, w), f"{precision}, optimizer {optimizer}, step {step}: not bitwise equal"
    home = home_of(engine)
    assert home is not None and home.path.is_file() and home.path.parents[2] == ROOT / SWAP_DIR
    assert engine._strategy._lp_shard.data_ptr() == home.tensor.data_ptr()  # the mapping
    home.close()
    assert not home.dir.exists(), "the swap file is removed at close"


def test_at_most_max_in_cpu_elements_stay_in_memory(groups) -> None:
    """max_in_cpu of 1 element: only the unit being read stays mapped in; each step writes every
    shard back and drops it, and pages every unit in again. With the default bound the units
    stay in between uses."""
    rank, world = groups.rank, groups.world_size
    engine = init_engine(make_model(), config("fp32", "nvme", max_in_cpu=1))
    home = home_of(engine)
    plan = engine._strategy._plan
    largest = max(e - s for s, e in (plan.shard_range(u) for u in range(len(plan.buckets))))
    peaks, reads, evictions = [], [], []
    original_use, original_evict = home.use, home.evict_all

    def watched(start: int, end: int) -> None:
        original_use(start, end)
        peaks.append(home.resident_numel)

    def evict() -> None:
        original_evict()
        evictions.append(home.resident_numel)

    home.use, home.evict_all = watched, evict
    from engine_helpers import global_batches

    for batch in global_batches(3, 2 * 2 * world):
        before = home.reads_advised
        train_engine(engine, [batch], rank, world)  # (its snapshot gathers every unit too)
        reads.append(home.reads_advised - before)
    assert peaks and max(peaks) <= largest, (max(peaks), largest)
    assert evictions == [0, 0, 0], "each step writes every shard back and drops it"
    units = len(plan.buckets)
    assert all(r >= units - 1 for r in reads), (reads, units)  # every unit read again each step
    roomy = init_engine(make_model(), config("fp32", "nvme"))
    train_engine(roomy, global_batches(1, 2 * 2 * world), rank, world)
    assert home_of(roomy).resident_numel > largest, "with room, units stay in between uses"
    home.close()
    home_of(roomy).close()


def test_checkpoint_resume_and_cpu_offload_loads_it(groups, shared_dir: Path) -> None:
    rank, world = groups.rank, groups.world_size
    from engine_helpers import global_batches

    batches = global_batches(6, 2 * 2 * world)
    straight = init_engine(make_model(), config("fp32", "nvme"))
    _, want = train_engine(straight, batches, rank, world)
    first = init_engine(make_model(), config("fp32", "nvme"))
    train_engine(first, batches[:3], rank, world)
    first.save_checkpoint(str(shared_dir))
    resumed = init_engine(make_model(seed=4), config("fp32", "nvme"))
    resumed.load_checkpoint(str(shared_dir))
    _, got = train_engine(resumed, batches[3:], rank, world)
    for step, (a_list, b_list) in enumerate(zip(got, want[3:])):
        assert all(torch.equal(a, b) for a, b in zip(a_list, b_list)), f"resumed step {step}"
    cpu = init_engine(make_model(seed=4), config("fp32", "cpu"))
    cpu.load_checkpoint(str(shared_dir))
    _, on_cpu = train_engine(cpu, batches[3:], rank, world)
    for step, (a_list, b_list) in enumerate(zip(on_cpu, want[3:])):
        assert all(torch.equal(a, b) for a, b in zip(a_list, b_list)), (
            f"CPU offload from an NVMe checkpoint, step {step}")
    for e in (straight, first, resumed):
        home_of(e).close()


def test_stale_swap_dirs_are_removed_and_never_read(groups, tmp_path: Path) -> None:
    """A swap directory left by a killed run (its pid is gone) is removed when the next run
    starts; the new run's shard holds the model's values, not the stale file's."""
    stale = tmp_path / SWAP_DIR / "dead-run" / f"rank{groups.rank}"
    stale.mkdir(parents=True)
    (stale.parent / "owner").write_text(f"{__import__('socket').gethostname()} 999999999\n")
    (stale / "params.swp").write_bytes(b"\x7f" * 4096)
    cfg = config("fp32", "nvme")
    cfg["zero_optimization"]["offload_param"]["nvme_path"] = str(tmp_path)
    engine = init_engine(make_model(), cfg)
    assert not stale.parent.exists()
    home = home_of(engine)
    reference = init_engine(make_model(), config("fp32", "cpu"))
    assert torch.equal(home.tensor, reference._strategy._lp_shard)
    home.close()
