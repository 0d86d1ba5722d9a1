"""DeepSpeed-layout translation without DeepSpeed: checkpoints laid out by DeepSpeed 0.19's rules
(written here with plain torch.save) are read back exactly, and unmappable ones are refused.
tests/launch/test_ds_checkpoint.py does the same with checkpoints real DeepSpeed writes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from zeroshard.checkpoint import get_fp32_state_dict_from_zero_checkpoint
from zeroshard.checkpoint.ds_import import DeepSpeedReader, read_layout
from zeroshard.errors import CheckpointError

PARAMS = {"a.weight": (4, 5), "b.weight": (7,), "c.bias": (3,)}
WORLD = 2


def _values(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in PARAMS.items()}


def _model_file(tag: Path, module: dict[str, torch.Tensor], stage: int, **extra: object) -> None:
    tag.mkdir(parents=True)
    (tag.parent / "latest").write_text(tag.name)
    state = {"module": module, "buffer_names": [], "optimizer": None, "lr_scheduler": {"last_batch_iteration": 4},
             "global_steps": 5, "global_samples": 40, "skipped_steps": 1, "dp_world_size": WORLD, "mp_world_size": 1,
             "ds_config": {"zero_optimization": {"stage": stage}}, "ds_version": "0.19.8", "epoch": 3, **extra}
    name = "mp_rank_00_model_states.pt" if stage < 3 else None
    if name:
        torch.save(state, tag / name)
    return state  # type: ignore[return-value]


def write_stage2(root: Path) -> dict[str, torch.Tensor]:
    """One group; the flat buffer (params in order) padded to 2 * partition, cut in rank order."""
    values = _values()
    tag = root / "global_step5"
    _model_file(tag, {n: v.to(torch.bfloat16) for n, v in values.items()}, 2,
                param_shapes=[{n: torch.Size(s) for n, s in PARAMS.items()}], shared_params={})
    flat = torch.cat([v.reshape(-1) for v in values.values()])
    part = math.ceil(flat.numel() / WORLD)
    flat = torch.cat([flat, torch.zeros(part * WORLD - flat.numel())])
    offsets, pos = {}, 0
    for n, s in PARAMS.items():
        offsets[n] = pos
        pos += math.prod(s)
    for r in range(WORLD):
        lo, hi = r * part, (r + 1) * part
        mapping = {}
        for n, s in PARAMS.items():
            a, b = max(lo, offsets[n]), min(hi, offsets[n] + math.prod(s))
            if a < b:
                mapping[n] = {"start": a - lo, "numel": b - a}
        shard = flat[lo:hi].clone()
        osd = {"single_partition_of_fp32_groups": [shard], "param_slice_mappings": [mapping],
               "base_optimizer_state": {"state": {0: {"step": torch.tensor(5.0), "exp_avg": shard * 0.5,
                                                      "exp_avg_sq": shard * shard}},
                                        "param_groups": [{"lr": 0.1, "params": [0]}]},
               "loss_scaler": {"cur_scale": 1.0, "dynamic": False}, "zero_stage": 2, "partition_count": [WORLD]}
        torch.save({"optimizer_state_dict": osd}, tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    return values


def write_stage3(root: Path) -> dict[str, torch.Tensor]:
    """Each parameter cut into ceil(numel / world) elements per rank; a rank's flat group is its
    pieces, each padded to that length, in order."""
    values = _values(1)
    tag = root / "global_step5"
    tag.mkdir(parents=True)
    (root / "latest").write_text(tag.name)
    for r in range(WORLD):
        pieces = []
        for v in values.values():
            per = math.ceil(v.numel() / WORLD)
            piece = v.reshape(-1)[r * per : (r + 1) * per]
            pieces.append(torch.cat([piece, torch.zeros(per - piece.numel())]))
        flat = torch.cat(pieces)
        model = {"module": {n: torch.empty(0) for n in PARAMS}, "buffer_names": [], "optimizer": None,
                 "param_shapes": [{n: torch.Size(s) for n, s in PARAMS.items()}], "frozen_param_shapes": None,
                 "shared_params": {}, "frozen_param_fragments": {}, "lr_scheduler": None, "global_steps": 5,
                 "global_samples": 40, "skipped_steps": 0, "dp_world_size": WORLD, "mp_world_size": 1,
                 "ds_config": {"zero_optimization": {"stage": 3}}, "ds_version": "0.19.8"}
        torch.save(model, tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        osd = {"fp32_flat_groups": [flat], "zero_stage": 3, "partition_count": WORLD,
               "loss_scaler": {"cur_scale": 1.0, "dynamic": False},
               "optimizer_state_dict": {"state": {0: {"step": torch.tensor(5.0), "exp_avg": flat + 1,
                                                      "exp_avg_sq": flat * 0}},
                                        "param_groups": [{"lr": 0.1, "params": [0]}]}}
        torch.save({"optimizer_state_dict": osd}, tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    return values


@pytest.mark.parametrize("write", [write_stage2, write_stage3])
def test_masters_and_moments_reassemble(tmp_path: Path, write: object) -> None:
    values = write(tmp_path)  # type: ignore[operator]
    layout = read_layout(tmp_path / "global_step5", None)
    assert [p.name for p in layout.manifest.params] == list(PARAMS)
    reader = DeepSpeedReader(layout)
    index = reader.master_index()
    for name, value in values.items():
        # An arbitrary range across the rank boundary, as a reshard at another world size asks.
        master, state = reader.masters(index, name, 1, value.numel() - 1)
        assert torch.equal(master, value.reshape(-1)[1:])
        if write is write_stage2:
            assert torch.equal(state["exp_avg"], value.reshape(-1)[1:] * 0.5)
        else:
            assert torch.equal(state["exp_avg"], value.reshape(-1)[1:] + 1)
        assert float(state["step"]) == 5.0
    run = reader.file("mp_rank_00_model_states.pt")
    assert (run["global_steps"], run["global_samples"]) == (5, 40)
    consolidated = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert set(consolidated) == set(PARAMS)
    assert all(torch.equal(consolidated[n], values[n]) for n in PARAMS)


@pytest.mark.parametrize("extra, word", [("layer_01-model_00-model_states.pt", "pipeline"),
                                         ("expert_0_mp_rank_00_model_states.pt", "MoE"),
                                         ("zero_pp_rank_0_mp_rank_01_optim_states.pt", "tensor")])
def test_unmappable_files_are_refused_by_name(tmp_path: Path, extra: str, word: str) -> None:
    write_stage2(tmp_path)
    (tmp_path / "global_step5" / extra).write_bytes(b"")
    with pytest.raises(CheckpointError, match=rf"{extra}.*{word}"):
        read_layout(tmp_path / "global_step5", None)


def test_model_parallel_save_is_refused(tmp_path: Path) -> None:
    write_stage2(tmp_path)
    path = tmp_path / "global_step5" / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    torch.save({**state, "mp_world_size": 2}, path)
    with pytest.raises(CheckpointError, match="mp_world_size 2"):
        read_layout(tmp_path / "global_step5", None)


def test_missing_rank_file_is_refused(tmp_path: Path) -> None:
    write_stage2(tmp_path)
    (tmp_path / "global_step5" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="zero_pp_rank_1.*missing"):
        read_layout(tmp_path / "global_step5", None)
