"""The slice reader behind the sharded `from_pretrained` (zeroshard/compat/hf_loading.py): any flat
range of a safetensors tensor, read through its rows, equals the same range of the whole tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("transformers")

from safetensors import safe_open
from safetensors.torch import save_file

from zeroshard.compat.hf_loading import read_flat_range


@pytest.mark.parametrize("shape", [(), (7,), (5, 3), (4, 3, 2), (1, 11)])
def test_every_range_of_every_shape(tmp_path: Path, shape: tuple[int, ...]) -> None:
    t = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float32).reshape(shape)
    save_file({"t": t}, tmp_path / "m.safetensors")
    flat = t.reshape(-1)
    with safe_open(tmp_path / "m.safetensors", framework="pt") as f:
        view = f.get_slice("t")
        for start in range(flat.numel() + 1):
            for end in range(start, flat.numel() + 1):
                got = read_flat_range(view, shape, start, end)
                assert torch.equal(got, flat[start:end]), (shape, start, end)


def test_save_on_each_node_is_accepted_and_reaches_the_checkpointer() -> None:
    """Trainer(save_on_each_node=True) writes checkpoint.use_node_local_storage: accepted, and the
    engine's checkpointer then writes one directory per node (tests/dist/test_node_local_checkpoint.py)."""
    import zeroshard
    from zeroshard.examples.gpt import GPT, GPTConfig

    cfg = {"train_micro_batch_size_per_gpu": 1, "checkpoint": {"use_node_local_storage": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zeroshard.initialize(model=GPT(GPTConfig.preset("tiny")), config=cfg)
    assert engine.zs_config.checkpoint.use_node_local_storage
    assert engine.checkpointer._node_leader == 0  # one process: its own node's first rank
    cfg["checkpoint"]["use_node_local_storage"] = False
    engine, *_ = zeroshard.initialize(model=GPT(GPTConfig.preset("tiny")), config=cfg)
    assert engine.checkpointer._node_leader is None


def test_sharded_load_hook_leaves_transformers_4_loader_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 4.x's `_load_pretrained_model` is a classmethod with another argument list
    (DeepSpeed-Chat pins 4.x): wrapping it broke every ZeRO-3 from_pretrained there (TypeError on
    ignore_mismatched_sizes). The hook installs only over transformers 5's static loader."""
    import sys
    import types

    from zeroshard.compat.hf_loading import install_transformers_hook

    class PreTrainedModel:  # transformers 4.57's shape
        @classmethod
        def _load_pretrained_model(cls, model, state_dict, checkpoint_files, pretrained_model_name_or_path,
                                   ignore_mismatched_sizes=False, sharded_metadata=None):
            return "4.x loader"

    fake = types.ModuleType("transformers.modeling_utils")
    fake.PreTrainedModel = PreTrainedModel
    monkeypatch.setitem(sys.modules, "transformers.modeling_utils", fake)
    before = PreTrainedModel.__dict__["_load_pretrained_model"]
    assert install_transformers_hook() is False
    assert PreTrainedModel.__dict__["_load_pretrained_model"] is before
    assert PreTrainedModel._load_pretrained_model(None, None, None, "x", ignore_mismatched_sizes=True) == "4.x loader"

    class PreTrainedModel5:  # transformers 5's shape: wrapped
        @staticmethod
        def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, expected_keys=None):
            return "5.x loader"

    fake.PreTrainedModel = PreTrainedModel5
    assert install_transformers_hook() is True
    assert PreTrainedModel5.__dict__["_load_pretrained_model"].__func__.__wrapped__ is not None
