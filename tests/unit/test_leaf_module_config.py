"""`zero_optimization.leaf_module` {classes, names, name_suffixes}: read (a single string is a
one-item list, as in DeepSpeed) and acted on at stage 3 (the named modules become leaves)."""

from __future__ import annotations

import torch
from torch import nn

import zeroshard
from zeroshard.config import load_config
from zeroshard.config.schema_zero import DEFAULT_LEAF_MODULE_CLASSES
from zeroshard.zero.leaf import z3_leaf_module


def test_section_reads_strings_as_one_item_lists_and_defaults_to_deepspeeds() -> None:
    zero = {"stage": 3, "leaf_module": {"classes": "my.Class", "names": "block", "name_suffixes": ["experts"]}}
    cfg = load_config({"train_batch_size": 1, "zero_optimization": zero}, dp_world_size=1)
    leaf = cfg.zero_optimization.leaf_module
    assert (leaf.classes, leaf.names, leaf.name_suffixes) == (("my.Class",), ("block",), ("experts",))
    default = load_config({"train_batch_size": 1}, dp_world_size=1).zero_optimization.leaf_module
    assert default.classes == DEFAULT_LEAF_MODULE_CLASSES and default.names == () and default.name_suffixes == ()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.experts[0](x) + self.experts[1](x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Block()
        self.second = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x)).sum()


def test_stage3_marks_the_named_modules_as_leaves() -> None:
    model = Model()
    config = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "leaf_module": {"names": "first", "name_suffixes": "second.experts"}}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert z3_leaf_module(model.first) and z3_leaf_module(model.second.experts)
    assert not z3_leaf_module(model.second) and not z3_leaf_module(model.first.experts)
    engine.backward(engine(torch.ones(1, 4)))
    engine.step()
