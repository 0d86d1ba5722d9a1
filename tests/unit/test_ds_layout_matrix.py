"""DeepSpeed ZeRO-1/2 checkpoints of any shape map onto zeroshard's fragments (issue 24 item 1),
without DeepSpeed: a generated matrix of parameter sets written by tests/unit/ds_layout.py, which
follows DeepSpeed 0.19's layout rules (checked against files real DeepSpeed wrote in
tests/launch/test_ds_checkpoint_matrix.py). Every master and moment must read back exactly,
whole and over ranges that cut across the saved partitions, as a load at another world size asks.
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ds_layout import plan, write_zero12

from zeroshard.checkpoint import get_fp32_state_dict_from_zero_checkpoint
from zeroshard.checkpoint.ds_import import DeepSpeedReader, read_layout
from zeroshard.errors import CheckpointError


def _straddle(world: int) -> list[tuple[int, ...]]:
    """Every partition boundary r * 12 cuts a 2-element parameter; the flat ends 3 short of W * 12."""
    cuts = [0] + [c for r in range(1, world) for c in (12 * r - 1, 12 * r + 1)] + [12 * world - 3]
    return [(b - a,) for a, b in itertools.pairwise(cuts)]


SETS = {
    "odd": lambda w: [(3, 5), (7,), (1,), (9, 11), (13,)],
    "prime": lambda w: [(97,), (101,), (11, 13), (2,), (3,)],
    "tiny": lambda w: [(1,), (1,), (2,), (1,)],
    "straddle": _straddle,
    "issue": lambda w: [(67, 16), (16,), (16, 64), (64,), (128, 512), (3,)],
}
"""Parameter sets: odd and prime sizes, sizes below the world size (whole partitions are padding),
a parameter across each partition boundary, and the issue's shape (a 128 x 512 weight whose last
element lies past a boundary, on a padded last rank)."""

VARIANTS = [  # (round_robin, parameter_alignment, lp dtype, two groups, frozen + tied)
    (False, False, torch.float32, False, False),
    (False, False, torch.bfloat16, True, True),
    (True, False, torch.float32, True, False),
    (False, True, torch.float16, False, True),
    (True, True, torch.bfloat16, True, True),
]


def _params(name: str, world: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}.weight": torch.randn(s, generator=g) for i, s in enumerate(SETS[name](world))}


CASES = [(s, w, v) for s in SETS for w in (2, 3, 4) for v in range(len(VARIANTS))]


@pytest.mark.parametrize("name, world, variant", CASES, ids=[f"{s}-w{w}-v{v}" for s, w, v in CASES])
def test_generated_layouts_read_back_exactly(tmp_path: Path, name: str, world: int, variant: int) -> None:
    rr, align, dtype, two_groups, extras = VARIANTS[variant]
    params = _params(name, world, seed=world * 10 + variant)
    names = list(params)
    frozen, tied = {}, {}
    if extras and len(names) > 2:
        frozen = {"frozen.weight": params.pop(names[1])}  # a frozen one, not in the optimizer
        tied = {"tied.weight": names[0]}  # a second module name of the first tensor
    items = list(params.items())
    groups = ([[i for i in items if i[1].dim() > 1], [i for i in items if i[1].dim() <= 1]] if two_groups
              else [items])
    groups = [g for g in groups if g]
    moments = write_zero12(tmp_path, groups, world, frozen=frozen, tied=tied, round_robin=rr,
                           parameter_alignment=align, lp_dtype=dtype)
    layout = read_layout(tmp_path / "global_step3", None)
    trainable = [p.name for p in layout.manifest.params if p.trainable]
    assert sorted(trainable) == sorted(params) and layout.manifest.aliases == tied
    assert [p.name for p in layout.manifest.params if not p.trainable] == list(frozen)
    reader = DeepSpeedReader(layout)
    index = reader.master_index()
    for n, value in params.items():
        numel = value.numel()
        flat = value.reshape(-1)
        # whole, and the two halves a 2-rank load asks for, and 1-element edges
        for off, k in {(0, numel), (0, numel // 2 or 1), (numel // 2, numel - numel // 2), (numel - 1, 1)}:
            if k <= 0 or off + k > numel:
                continue
            master, state = reader.masters(index, n, off, k)
            assert torch.equal(master, flat[off : off + k]), (n, off, k)
            assert torch.equal(state["exp_avg"], moments[n + ".exp_avg"][off : off + k]), (n, off, k)
            assert float(state["step"]) == 3.0
    consolidated = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    for n, value in params.items():
        assert torch.equal(consolidated[n], value), n
    assert torch.equal(consolidated["tied.weight"], consolidated[names[0]]) if tied else True
    reader.close()


def test_plan_pads_and_straddles_as_deepspeed_does() -> None:
    # The issue's failure: the last rank's saved partition is cut at the parameters' end, so
    # partition r starts at r * P (P the padded size), not at r * (the saved length).
    p = plan([[("a", 5), ("b", 6)]], 4)
    assert p.partition == [4]  # 11 -> 16 (a multiple of 2 * 4), 4 per rank
    assert [r.lean_numel[0] for r in p.ranks] == [4, 4, 3, 0]
    assert [r.group_paddings[0] for r in p.ranks] == [0, 0, 1, 4]
    assert [r.mappings[0] for r in p.ranks] == [{"a": (0, 4)}, {"a": (0, 1), "b": (1, 3)}, {"b": (0, 3)}, {}]
    rr = plan([[("a", 1), ("b", 2), ("c", 3)]], 2, round_robin=True)
    assert rr.flat_order == [["a", "c", "b"]]
    aligned = plan([[("a", 3), ("b", 5)]], 2, parameter_alignment=True, element_size=2)
    assert aligned.param_paddings == [[5, 0]] and aligned.offsets == [{"a": 0, "b": 8}]


def test_mappings_that_disagree_with_the_layout_are_refused(tmp_path: Path) -> None:
    params = _params("odd", 2, 0)
    write_zero12(tmp_path, [list(params.items())], 2)
    path = tmp_path / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = torch.load(path, weights_only=False)
    first = next(iter(data["optimizer_state_dict"]["param_slice_mappings"][0]))
    data["optimizer_state_dict"]["param_slice_mappings"][0][first]["start"] += 1
    torch.save(data, path)
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: param_slice_mappings"):
        read_layout(tmp_path / "global_step3", None)


def test_partitions_of_different_saves_are_refused(tmp_path: Path) -> None:
    params = _params("prime", 2, 0)
    write_zero12(tmp_path, [list(params.items())], 2)
    path = tmp_path / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = torch.load(path, weights_only=False)
    part = data["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    data["optimizer_state_dict"]["single_partition_of_fp32_groups"][0] = part[: math.ceil(part.numel() / 2)]
    torch.save(data, path)
    with pytest.raises(CheckpointError, match="differ in size across ranks"):
        read_layout(tmp_path / "global_step3", None)
