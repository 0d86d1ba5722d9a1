"""Pipeline checkpoints without a process group: global names <-> the names of the same layers
without a pipeline, the layout file, and DeepSpeed's pipeline files (written by
tests/dist/ds_pipe_writer.py with DeepSpeed 0.19's layout rules) read back exactly at every stage
and data-parallel degree, and consolidated by to-fp32."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))
from ds_pipe_writer import write_ds_pipeline

from zeroshard.checkpoint import get_fp32_state_dict_from_zero_checkpoint
from zeroshard.checkpoint.ds_pipe import deepspeed_pipeline_sources
from zeroshard.checkpoint.pipe_files import MultiReader, PipeLayout, pipeline_to_plain, plain_to_pipeline
from zeroshard.errors import CheckpointError
from zeroshard.pipe import LayerSpec, TiedLayerSpec
from zeroshard.pipe.module import SequentialLayers

TIED = {"embed": [0, 5]}


def test_names_map_both_ways() -> None:
    assert pipeline_to_plain("tied_modules.embed.weight", TIED) == "0.weight"
    assert pipeline_to_plain("3.fc.weight", TIED) == "3.fc.weight"
    assert plain_to_pipeline("0.weight", TIED) == "tied_modules.embed.weight"
    assert plain_to_pipeline("5.weight", TIED) == "tied_modules.embed.weight"  # a later use of the tie
    assert plain_to_pipeline("3.fc.weight", TIED) == "3.fc.weight"
    assert plain_to_pipeline("tied_modules.embed.weight", TIED) == "tied_modules.embed.weight"


def test_layout_file_round_trips_and_refuses_garbage(tmp_path: Path) -> None:
    layout = PipeLayout(num_stages=2, parts=[0, 3, 6], tied=TIED, num_layers=6)
    assert PipeLayout.from_json(layout.to_json(), tmp_path) == layout
    with pytest.raises(CheckpointError, match="not a pipeline layout file"):
        PipeLayout.from_json('{"parts": 1}', tmp_path / "pipeline.json")


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x)


def test_to_sequential_names_a_tie_at_its_first_layer() -> None:
    layers = [TiedLayerSpec("embed", nn.Embedding, 3, 4), LayerSpec(nn.Linear, 4, 4),
              TiedLayerSpec("embed", nn.Embedding, 3, 4, forward_fn=lambda m, x: x @ m.weight.t())]
    model = SequentialLayers(layers)
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "1.weight", "1.bias"]
    assert model(torch.tensor([[0, 2]])).shape == (1, 2, 3)


def _ds_checkpoint(tmp_path: Path, zero: int, dp: int) -> tuple[Path, dict[str, tuple[torch.Tensor, dict]]]:
    """A 6-layer tied model (embed, 4 linear layers, tied head) cut at [0, 3, 6] into 2 stages."""
    g = torch.Generator().manual_seed(dp * 10 + zero)
    shapes = {"tied_modules.embed.weight": (5, 3)}
    for i in range(1, 5):
        shapes |= {f"{i}.weight": (3, 3), f"{i}.bias": (3,)}
    params = {n: (torch.randn(s, generator=g), {"step": torch.tensor(2.0), "exp_avg": torch.randn(s, generator=g),
                                               "exp_avg_sq": torch.rand(s, generator=g)}) for n, s in shapes.items()}
    stages = [["tied_modules.embed.weight", "1.weight", "1.bias", "2.weight", "2.bias"],
              ["tied_modules.embed.weight", "3.weight", "3.bias", "4.weight", "4.bias"]]
    layers = {0: {"weight": params["tied_modules.embed.weight"][0]}}
    layers |= {i: {"weight": params[f"{i}.weight"][0], "bias": params[f"{i}.bias"][0]} for i in range(1, 5)}
    ckpt = tmp_path / "global_step2"
    group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    write_ds_pipeline(ckpt, stages, params, layers, zero=zero, dp=dp, global_steps=2, param_group=group)
    return ckpt, params


@pytest.mark.parametrize("zero,dp", [(0, 1), (1, 1), (1, 2), (1, 3)])
def test_deepspeed_pipeline_files_read_back_exactly(tmp_path: Path, zero: int, dp: int) -> None:
    ckpt, params = _ds_checkpoint(tmp_path, zero, dp)
    layout = PipeLayout(num_stages=3, parts=[0, 2, 4, 6], tied=TIED, num_layers=6, partition=lambda n: [0, 3, 6])
    multi = MultiReader(deepspeed_pipeline_sources(ckpt, layout), 0, ckpt)
    index = multi.master_index()
    assert sorted(p.name for p in multi.manifest.params) == sorted(params)
    for name, (value, state) in params.items():
        flat = value.reshape(-1)
        for off, k in ((0, flat.numel()), (flat.numel() // 2, flat.numel() - flat.numel() // 2)):
            master, got = multi.masters(index, name, off, k)
            assert torch.equal(master, flat[off : off + k]), name
            assert torch.equal(got["exp_avg"], state["exp_avg"].reshape(-1)[off : off + k]), name
            assert torch.equal(got["exp_avg_sq"], state["exp_avg_sq"].reshape(-1)[off : off + k]), name
        assert torch.equal(multi.weights(name, 0, flat.numel(), torch.float32), flat)
    multi.close()
    consolidated = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert set(consolidated) == {pipeline_to_plain(n, TIED) for n in params}
    for name, (value, _) in params.items():
        assert torch.equal(consolidated[pipeline_to_plain(name, TIED)], value), name


def test_deepspeed_pipeline_of_another_partition_is_refused(tmp_path: Path) -> None:
    ckpt, _ = _ds_checkpoint(tmp_path, 1, 1)
    layout = PipeLayout(num_stages=2, parts=[0, 3, 6], tied=TIED, num_layers=6, partition=lambda n: [0, 2, 6])
    with pytest.raises(CheckpointError, match="another partition_method"):
        deepspeed_pipeline_sources(ckpt, layout)
