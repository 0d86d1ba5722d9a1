"""Config files and values as users have them (issue 9 item 5, issue 11 item 2): DeepSpeed's syntax
and legacy spellings load; bad inputs are refused by name, the same way by `zeroshard config check`
and by `initialize()`."""

from __future__ import annotations

import codecs
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import zeroshard
from zeroshard.cli.config_cmd import main as config_check
from zeroshard.config import load_config
from zeroshard.errors import ConfigError, NotSupportedError

BASE: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def load_text(tmp_path: Path, text: str | bytes, name: str = "ds_config.json") -> Any:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return load_config(path, dp_world_size=2)


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_text(tmp_path, text)
    return str(info.value)


# --- duplicate keys ---------------------------------------------------------------------------


def test_duplicate_key_is_refused_with_both_values(tmp_path: Path) -> None:
    text = '{"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "lr": 0.1}}}'
    assert error_of(tmp_path, text).endswith(
        "ds_config.json: optimizer.params.lr is given twice (0.001 and then 0.1); keep one. "
        "(A JSON reader would silently keep the last.)")


def test_duplicate_section_is_refused(tmp_path: Path) -> None:
    text = ('{"train_batch_size": 4, "zero_optimization": {"stage": 1},\n'
            ' "zero_optimization": {"stage": 2, "overlap_comm": true}}')
    assert ('zero_optimization is given twice ({"stage": 1} and then {"stage": 2, "overlap_comm": true})'
            in error_of(tmp_path, text))


def test_duplicate_in_hjson_file_is_refused(tmp_path: Path) -> None:
    text = '{\n  // hjson\n  train_batch_size: 4\n  train_batch_size: 8\n}'
    assert "train_batch_size is given twice (4 and then 8)" in error_of(tmp_path, text)


# --- non-finite and absurd numbers ------------------------------------------------------------


@pytest.mark.parametrize("literal, shown", [("Infinity", "Infinity"), ("-Infinity", "-Infinity"), ("NaN", "NaN")])
def test_non_finite_numbers_are_refused_anywhere(tmp_path: Path, literal: str, shown: str) -> None:
    for where, text in (
        ("optimizer.params.lr",
         f'{{"train_batch_size": 4, "optimizer": {{"type": "AdamW", "params": {{"lr": {literal}}}}}}}'),
        ("gradient_clipping", f'{{"train_batch_size": 4, "gradient_clipping": {literal}}}'),
        ("optimizer.params.momentum", f'{{"train_batch_size": 4, "optimizer": {{"type": "SGD", "params": '
                                      f'{{"lr": 0.1, "momentum": {literal}}}}}}}'),
        ("optimizer.params.betas[1]", f'{{"train_batch_size": 4, "optimizer": {{"type": "Adam", "params": '
                                      f'{{"betas": [0.9, {literal}]}}}}}}'),
    ):
        message = error_of(tmp_path, text)
        assert message.startswith(f"{where}: got {shown}, expected a finite number"), message


def test_infinity_still_means_never_for_steps_per_print(tmp_path: Path) -> None:
    assert load_text(tmp_path, '{"train_batch_size": 4, "steps_per_print": Infinity}').steps_per_print is None
    message = error_of(tmp_path, '{"train_batch_size": 4, "steps_per_print": -Infinity}')
    assert message.startswith("steps_per_print: got -Infinity, expected a finite number")


def test_dict_configs_get_the_same_checks() -> None:
    with pytest.raises(ConfigError, match=r"^optimizer\.params\.lr: got Infinity, expected a finite number"):
        load_config({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": math.inf}}}, dp_world_size=1)


@pytest.mark.parametrize("raw, message", [
    ({"train_batch_size": 10**30},
     "train_batch_size: got 1000000000000000000000000000000, expected an integer >= 1 and <= 2147483647. "
     "No real run has a batch of 2**31 samples; check for a typo."),
    ({"train_batch_size": 2**31}, "train_batch_size: got 2147483648, expected an integer >= 1 and <= 2147483647."),
    ({"train_batch_size": 4, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10**20}}},
     "scheduler.params.warmup_num_steps: got 100000000000000000000, larger than any real size or count"),
    ({"train_micro_batch_size_per_gpu": 2**30, "gradient_accumulation_steps": 2**30},
     "train_batch_size: derived as 2305843009213693952 from the other batch sizes, larger than any real run "
     "(the bound is 2147483647)"),
    ({"train_batch_size": 4, "zero_optimization": {"reduce_bucket_size": 1e30}},
     "zero_optimization.reduce_bucket_size: got 1e+30, larger than any real size or count (the bound is "
     "9223372036854775807, the int64 maximum). Default: 500000000."),
])
def test_sizes_that_cannot_be_real_are_refused(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(raw, dp_world_size=2)
    assert str(info.value).startswith(message), str(info.value)


# --- DeepSpeed's syntax and legacy spellings --------------------------------------------------


def test_utf8_bom_is_accepted(tmp_path: Path) -> None:
    cfg = load_text(tmp_path, codecs.BOM_UTF8 + json.dumps({"train_batch_size": 8}).encode())
    assert cfg.train_micro_batch_size_per_gpu == 4


def test_hjson_config_as_deepspeed_reads_it(tmp_path: Path) -> None:
    text = """{
      # DeepSpeed reads ds_config files with hjson
      train_batch_size: 8,
      "zero_optimization": {
        "stage": 2, // comments after values
        /* block comments */
        "overlap_comm": true,
      },
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95],}},
    }"""
    cfg = load_text(tmp_path, text, "ds_config.hjson")
    assert (cfg.train_batch_size, cfg.zero_optimization.stage, cfg.zero_optimization.overlap_comm) == (8, 2, True)
    assert cfg.optimizer.params.betas == (0.9, 0.95) and cfg.optimizer.params.lr == 1e-4


def test_unknown_key_in_hjson_is_still_named(tmp_path: Path) -> None:
    assert error_of(tmp_path, "{\n train_batch_size: 8\n zero_optimisation: {stage: 1}\n}").startswith(
        'zero_optimisation: unknown key. Did you mean "zero_optimization"?')


@pytest.mark.parametrize("section", [
    {"compile": {"deepcompile": False}},
    {"compile": {"deepcompile": False, "free_activation": False, "offload_activation": False}},
    {"tensor_parallel": {"autotp_size": 1}},
    {"tensor_parallel": {"autotp_size": 0, "tp": {"tp_size": 1}}},
    {"seq_parallel_communication_data_type": "fp32"},
    {"managed_gradient_accumulation": True},
    {"disable_python_gc": False},
    {"expert_parallel": {"enabled": False}},
])
def test_newer_deepspeed_sections_that_ask_for_nothing_load(section: dict[str, Any]) -> None:
    assert load_config({**BASE, **section}, dp_world_size=1).train_micro_batch_size_per_gpu == 2


def test_legacy_configs_from_deepspeed_templates_load() -> None:
    cfg = load_config({**BASE, "zero_optimization": {"stage": 2, "cpu_offload": True},
                       "zero_force_ds_cpu_optimizer": False, "gradient_allreduce_op": "mean",
                       "checkpoint": {"tag_validation": "fail"},
                       "bf16": {"enabled": True, "immediate_grad_update": True, "check_grad_overflow": False},
                       "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}},
                      dp_world_size=2)
    assert cfg.zero_optimization.offload_optimizer.device == "cpu" and cfg.checkpoint.tag_validation == "Fail"
    assert cfg.bf16.immediate_grad_update and not cfg.bf16.check_grad_overflow and cfg.optimizer.params.torch_adam
    assert any("cpu_offload is deprecated" in note for note in cfg.notes)


# --- `zeroshard config check` and initialize() give the same verdict -------------------------


BAD_FOR_BOTH: list[tuple[dict[str, Any], str]] = [
    ({"fp16": {"enabled": True, "min_loss_scale": 0}},
     "fp16.min_loss_scale: got 0.0, expected a number > 0 and <= the initial loss scale"),
    ({"fp16": {"enabled": True, "initial_scale_power": 2, "min_loss_scale": 8}},
     "fp16.min_loss_scale: got 8.0, expected a number > 0 and <= the initial loss scale "
     "2**fp16.initial_scale_power = 4"),
    ({"optimizer": {"type": "Lamb", "params": {"min_coeff": 2.0, "max_coeff": 1.0}}},
     "optimizer.params.min_coeff: got 2.0, expected <= optimizer.params.max_coeff (1.0)."),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}, 'optimizer.params.lr: got "fast", expected a number'),
]


@pytest.mark.parametrize("overrides, message", BAD_FOR_BOTH)
def test_config_check_and_initialize_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           overrides: dict[str, Any], message: str) -> None:
    raw = {**BASE, **overrides}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(raw))
    assert config_check(["check", str(path)]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(ConfigError) as info:
        zeroshard.initialize(model=torch.nn.Linear(2, 2), config=raw)
    assert message in str(info.value)


def test_fp16_static_scale_ignores_min_loss_scale() -> None:
    """min_loss_scale only bounds the dynamic scale; a static scale with min 0 loads (as in DeepSpeed)."""
    cfg = load_config({**BASE, "fp16": {"enabled": True, "loss_scale": 128, "min_loss_scale": 0}}, dp_world_size=1)
    assert cfg.fp16.initial_loss_scale == 128.0


def test_not_supported_is_a_config_error_for_both(tmp_path: Path) -> None:
    raw = {**BASE, "compile": {"deepcompile": True}}
    with pytest.raises(NotSupportedError, match=r"^not supported yet: compile\.deepcompile=true\. DeepCompile .* "
                       r"Remove the key \(or set it to false\) and call engine\.compile\(\)\.$"):
        load_config(raw, dp_world_size=1)
    with pytest.raises(NotSupportedError, match=r"^not supported yet: compile\.deepcompile="):
        zeroshard.initialize(model=torch.nn.Linear(2, 2), config=raw)


def test_initialize_logs_the_stage_note_once(caplog: pytest.LogCaptureFixture) -> None:
    raw = {**BASE, "zero_optimization": {"stage": 1, "stage3_prefetch_bucket_size": 1e6, "sub_group_size": 1e8}}
    logger = logging.getLogger("zeroshard")
    propagate = logger.propagate
    logger.addHandler(caplog.handler)
    logger.propagate = False  # count each record once, whether or not setup_logging ran before
    try:
        zeroshard.initialize(model=torch.nn.Linear(2, 2), config=raw)
    finally:
        logger.removeHandler(caplog.handler)
        logger.propagate = propagate
    notes = [r.getMessage() for r in caplog.records if "set for another ZeRO stage" in r.getMessage()]
    assert notes == ["zero_optimization: set for another ZeRO stage, no effect at stage 1: sub_group_size "
                     "(stage 3), stage3_prefetch_bucket_size (stage 3). Accepted so one config serves every stage."]
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.getMessage() in notes)


@pytest.mark.parametrize("content, what", [("", "0 bytes"), ("\n  \n", "4 characters of whitespace only"),
                                           ("\ufeff", "0 bytes")])
def test_empty_config_file_says_it_is_empty(tmp_path: Path, content: str, what: str) -> None:
    # An empty file used to report both batch keys missing, as if the keys were the problem.
    path = tmp_path / "ds_config.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path, dp_world_size=1)
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"{path}: the config file is empty ({what})"), first
    assert "train_batch_size" not in first and "JSON object" in first, first


def test_zero_allow_untested_optimizer_reads_an_integer_as_its_truth_value() -> None:
    """DeepSpeed tests the key by truthiness (its own tests write `1`); other bools stay strict."""
    assert load_config({"train_batch_size": 1, "zero_allow_untested_optimizer": 1}, dp_world_size=1) \
        .zero_allow_untested_optimizer is True
    assert load_config({"train_batch_size": 1, "zero_allow_untested_optimizer": 0}, dp_world_size=1) \
        .zero_allow_untested_optimizer is False
    with pytest.raises(ConfigError, match="zero_allow_untested_optimizer"):
        load_config({"train_batch_size": 1, "zero_allow_untested_optimizer": "yes"}, dp_world_size=1)
    with pytest.raises(ConfigError, match="fp16.enabled"):
        load_config({"train_batch_size": 1, "fp16": {"enabled": 1}}, dp_world_size=1)
