"""The `compile` section (DeepSpeed 0.19.8's keys: each accepted at its default, refused by name
otherwise) and `engine.compile()`'s refusals, at world size 1 without compiling anything."""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import pytest
import torch

import zeroshard
from zeroshard.config import load_config
from zeroshard.config.schema_compile import CompileConfig
from zeroshard.errors import ConfigError, NotSupportedError
from zeroshard.runtime.engine import ZeroEngine

BASE = {"train_batch_size": 2}
FEATURES = ("deepcompile", "autoep_non_moe")
DEEPCOMPILE_ONLY = [f.name for f in dataclasses.fields(CompileConfig) if f.name not in FEATURES]


def _other(value: Any) -> Any:
    return {bool: lambda v: not v, int: lambda v: v + 1}.get(type(value), lambda v: ["z1"])(value)


def test_defaults_spelled_out_load() -> None:
    spelled = {f.name: list(f.default) if isinstance(f.default, tuple) else f.default
               for f in dataclasses.fields(CompileConfig)}
    assert load_config({**BASE, "compile": spelled}, dp_world_size=1).compile == CompileConfig()
    assert load_config({**BASE, "compile": {}}, dp_world_size=1).compile == CompileConfig()


@pytest.mark.parametrize("key, why", [
    ("deepcompile", "DeepCompile .* is not implemented; engine.compile"),
    ("autoep_non_moe", r"engine.compile\(\) compiles the whole model; keeping the AutoEP layers eager is not built"),
])
def test_feature_keys_refused_by_name(key: str, why: str) -> None:
    with pytest.raises(NotSupportedError, match=rf"^not supported yet: compile\.{key}=true\. {why}"):
        load_config({**BASE, "compile": {key: True}}, dp_world_size=1)


@pytest.mark.parametrize("key", DEEPCOMPILE_ONLY)
def test_deepcompile_tuning_keys_refused_by_name(key: str) -> None:
    value = _other(getattr(CompileConfig(), key))
    with pytest.raises(NotSupportedError, match=rf"^not supported yet: compile\.{key}=.* It tunes DeepCompile"):
        load_config({**BASE, "compile": {key: value}}, dp_world_size=1)


def test_typos_and_bad_values_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=re.escape('compile.deep_compile: unknown key. Did you mean "deepcompile"?')):
        load_config({**BASE, "compile": {"deep_compile": False}}, dp_world_size=1)
    with pytest.raises(ConfigError, match=r"^compile\.passes: got \[\"z9\"\]"):
        load_config({**BASE, "compile": {"passes": ["z9"]}}, dp_world_size=1)


@pytest.fixture(scope="module")
def engine() -> ZeroEngine:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                      config={**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    return engine


@pytest.mark.parametrize("kwargs, message", [
    ({"schedule": [(0, ["z3"])]}, r"engine\.compile\(schedule=\.\.\.\) is not supported: .*DeepCompile"),
    ({"compiled_autograd_enabled": True}, r"engine\.compile\(compiled_autograd_enabled=True\) is not supported yet"),
])
def test_compile_arguments_refused_by_name(engine: ZeroEngine, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(NotSupportedError, match=message):
        engine.compile(**kwargs)
    assert not engine.is_compiled and engine.compile_stats is None


def test_model_parallel_layers_of_your_own_refused_by_name(engine: ZeroEngine,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An mpu's (or a Megatron-style PipelineModule's) model parallelism: its collectives are not
    zeroshard's, so compile refuses it; AutoTP (a `parallel.tp` state) and pipelines compile
    (tests/dist/test_compile.py)."""
    monkeypatch.setattr(ZeroEngine, "mp_world_size", property(lambda self: 2))
    with pytest.raises(NotSupportedError, match=r"engine\.compile\(\) with model-parallel layers of your own "
                                                r"\(an mpu"):
        engine.compile()
    assert not engine.is_compiled


def test_torch_nn_layers_alone_are_said_to_run_eagerly(caplog: pytest.LogCaptureFixture,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo does not compile torch's own modules (their frames are in torch's files): a model of
    nothing else, or a pipeline layer of nothing else, is reported as running eagerly, not counted as
    compiled (no forward runs here, so nothing is compiled)."""
    from zeroshard.pipe import LayerSpec, PipelineModule

    class Scaled(torch.nn.Module):  # code of the script's: compiled
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * self.inner(x)

    config = {**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    engine, *_ = zeroshard.initialize(model=plain, model_parameters=plain.parameters(), config=config)
    # initialize's setup_logging stops propagation to the root logger, where caplog listens: this test
    # alone (or first) saw no record; in the whole file an earlier test had left propagation on.
    monkeypatch.setattr(logging.getLogger("zeroshard"), "propagate", True)
    with caplog.at_level("WARNING", logger="zeroshard"):
        engine.compile()
    assert "only torch.nn modules, which Dynamo does not compile: it runs eagerly" in caplog.text
    caplog.clear()

    net = PipelineModule([LayerSpec(torch.nn.Embedding, 8, 4), LayerSpec(Scaled), LayerSpec(torch.nn.Linear, 4, 8)],
                         num_stages=1, loss_fn=torch.nn.functional.cross_entropy)
    engine, *_ = zeroshard.initialize(model=net, model_parameters=net.parameters(), config=config)
    with caplog.at_level("INFO", logger="zeroshard"):
        engine.compile()
    assert engine.compile_stats is not None and engine.compile_stats.regions == 1  # Scaled only
    assert "compiling 1 layer(s) of this rank's pipeline stage(s) (left eager: 0:Embedding, 2:Linear" in caplog.text
    assert "runs eagerly" not in caplog.text
    assert net.get_submodule("1")._compiled_call_impl is not None
    assert net.get_submodule("0")._compiled_call_impl is None
