"""DeepSpeed-visible engine behaviour at world size 1: misuse of `no_sync()` raises an error that
is both zeroshard's RuntimeError and DeepSpeed's AssertionError, and `sparse_tensor_module_names`
is the (empty) set of sparse-gradient embeddings, a fresh set per read."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.errors import UsageError

CONFIG = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


def _engine() -> zeroshard.DeepSpeedEngine:
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 2))
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=dict(CONFIG))
    return engine


def test_no_sync_reentry_is_runtime_and_assertion_error() -> None:
    engine = _engine()
    with engine.no_sync():
        with pytest.raises(UsageError, match="cannot be re-entered") as info:
            with engine.no_sync():
                pass
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, AssertionError)
    assert "no_sync context manager reentry is unsupported" in str(info.value)
    with engine.no_sync():  # the outer block left cleanly: entering again works
        pass


def test_step_inside_no_sync_is_assertion_error() -> None:
    engine = _engine()
    loss = engine(torch.tensor([[1, 2], [3, 4]])).sum()
    with engine.no_sync():
        engine.backward(loss)
        with pytest.raises(AssertionError, match="inside engine.no_sync"):
            engine.step()


def test_sparse_tensor_module_names_is_empty_and_fresh() -> None:
    engine = _engine()
    names = engine.sparse_tensor_module_names
    assert names == set()
    names.add("0.weight")
    assert engine.sparse_tensor_module_names == set()


@pytest.mark.parametrize("save_dir", [None, ""])
def test_empty_save_dir_is_a_value_error(save_dir: str | None) -> None:
    """DeepSpeed raises ValueError for it; zeroshard's CheckpointError is one too here."""
    from zeroshard.errors import CheckpointArgumentError, CheckpointError

    engine = _engine()
    with pytest.raises(ValueError, match="save_dir must name a directory") as info:
        engine.save_checkpoint(save_dir)
    assert isinstance(info.value, CheckpointError) and type(info.value) is CheckpointArgumentError


def test_offload_states_arguments_as_deepspeed_takes_them() -> None:
    """On the CPU nothing needs to move, but the call's contract holds: bad states and devices
    are refused by name, and the engine refuses training until reload_states()."""
    engine = _engine()
    with pytest.raises(ValueError, match=r"unknown state 'params'; the states are optim_states, hp_params"):
        engine.offload_states(include=["params"])
    with pytest.raises(ValueError, match=r"only \"cpu\" is supported"):
        engine.offload_states(device="nvme")
    engine.offload_states(device="none")  # DeepSpeed: a warning, nothing moved
    engine(torch.tensor([[1, 2], [3, 4]]))
    engine.offload_states(include=None, device="cpu", pin_memory=True, non_blocking=False)
    with pytest.raises(UsageError, match=r"^engine\.forward\(\) while the training states are offloaded"):
        engine(torch.tensor([[1, 2], [3, 4]]))
    with pytest.raises(UsageError, match="already offloaded"):
        engine.offload_states()
    engine.reload_states()
    engine.backward(engine(torch.tensor([[1, 2], [3, 4]])).sum())
    engine.step()
    engine.reload_states()  # nothing offloaded: nothing to do


def test_coalesce_grad_reduction_refuses_pipelines_and_exceptions_reduce_nothing() -> None:
    engine = _engine()
    engine.pipeline_parallelism = True
    with pytest.raises(NotImplementedError, match="pipeline parallelism"):
        with engine.coalesce_grad_reduction():
            pass
    engine.pipeline_parallelism = False
    with pytest.raises(KeyError), engine.coalesce_grad_reduction():
        engine.backward(engine(torch.tensor([[1, 2], [3, 4]])).sum())
        raise KeyError("the block failed")
    assert not engine.grads_ready and not engine._micro.no_sync


def test_offload_states_takes_deepspeeds_enums(deepspeed_alias: Any) -> None:
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    from zeroshard.runtime.offload_states import STATES

    assert [s.value for s in OffloadStateTypeEnum] == list(STATES)
    engine = _engine()
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params],
                          device=OffloadDeviceEnum.cpu, pin_memory=False, non_blocking=True)
    with pytest.raises(UsageError, match=r"\(hp_params, optim_states\): call engine.reload_states"):
        engine.step()
    engine.reload_states(non_blocking=True)
