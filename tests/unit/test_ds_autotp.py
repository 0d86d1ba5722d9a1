"""checkpoint/ds_autotp.py without an engine: DeepSpeed-format AutoTP files (tests/dist/ds_autotp_writer.py)
read back as whole parameters, masters and Adam moments, over ranges that cross the TP pieces and the
ZeRO partitions; what it cannot map is refused by name."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
from ds_autotp_writer import write_autotp

from zeroshard.checkpoint.ds_autotp import AutoTpReader, is_autotp, read_autotp_layout
from zeroshard.checkpoint_format import Manifest, TensorInfo
from zeroshard.errors import CheckpointError

SHAPES = {"a.weight": (8, 4), "b.weight": (4, 8), "n.weight": (5,), "h.weight": (12, 3)}
SPLITS = {"a.weight": 0, "b.weight": 1, "n.weight": None, "h.weight": 0}


def _hint(shapes: dict[str, tuple[int, ...]]) -> Manifest:
    params = [TensorInfo(n, s, "float32", True) for n, s in shapes.items()]
    return Manifest(world_size=1, zero_stage=0, precision="fp32", params=params, aliases={}, buffers=[],
                    optimizer="adam", param_groups=1, fragments=[[]], weight_pieces=None)


def _write(root: Path, tp: int, dp: int, stage: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(tp * 10 + dp + stage)
    weights = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    state = {n: {"step": torch.tensor(3.0), "exp_avg": torch.randn(s, generator=g),
                 "exp_avg_sq": torch.rand(s, generator=g)} for n, s in SHAPES.items()}
    write_autotp(root, "t", tp=tp, dp=dp, stage=stage, weights=weights, state=state,
                 param_groups=[{"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}],
                 splits=SPLITS, global_steps=3)
    return weights, state


@pytest.mark.parametrize("tp, dp, stage", [(2, 1, 0), (2, 2, 1), (2, 3, 2), (4, 2, 2)])
def test_pieces_read_back_whole(tmp_path: Path, tp: int, dp: int, stage: int) -> None:
    weights, state = _write(tmp_path, tp, dp, stage)
    ckpt = tmp_path / "t"
    assert is_autotp(ckpt)
    lay = read_autotp_layout(ckpt, _hint(SHAPES))
    assert {p.name: tuple(p.shape) for p in lay.manifest.params} == SHAPES
    assert lay.manifest.world_size == tp * (dp if stage else 1)
    reader = AutoTpReader(lay)
    index = reader.master_index()
    for name, value in weights.items():
        assert torch.equal(reader.module()[name], value), name
        flat = value.reshape(-1)
        for off, n in ((0, flat.numel()), (1, flat.numel() - 2)):  # whole, and a range across every cut
            master, st = reader.masters(index, name, off, n)
            assert torch.equal(master, flat[off : off + n]), name
            assert torch.equal(st["exp_avg"], state[name]["exp_avg"].reshape(-1)[off : off + n]), name
            assert torch.equal(st["exp_avg_sq"], state[name]["exp_avg_sq"].reshape(-1)[off : off + n]), name
            assert float(st["step"]) == 3.0
    reader.close()


def test_a_model_the_pieces_do_not_split_is_refused(tmp_path: Path) -> None:
    _write(tmp_path, 2, 1, 1)
    with pytest.raises(CheckpointError, match=r"'b.weight' is saved as 2 pieces of \[4, 4\], the model's parameter "
                                              r"is \[4, 6\]"):
        read_autotp_layout(tmp_path / "t", _hint({**SHAPES, "b.weight": (4, 6)}))
    with pytest.raises(CheckpointError, match="'h.weight' is not a parameter of the model being loaded"):
        read_autotp_layout(tmp_path / "t", _hint({n: s for n, s in SHAPES.items() if n != "h.weight"}))


def test_missing_rank_and_pipeline_directories(tmp_path: Path) -> None:
    _write(tmp_path, 2, 2, 2)
    ckpt = tmp_path / "t"
    (ckpt / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="zero_pp_rank_1_mp_rank_01_optim_states.pt: missing"):
        read_autotp_layout(ckpt, _hint(SHAPES))
    (ckpt / "layer_01-model_states.pt").write_bytes(b"")
    assert not is_autotp(ckpt)  # DeepSpeed's pipeline checkpoints also write one mp_rank file per stage
