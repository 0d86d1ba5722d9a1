"""Model specs: sizes from a live module, zeroshard's GPT, Hugging Face configs, or counts.

The built-in parameter counts (estimate/hf_count.py, used without transformers) are checked
against transformers' own models built on the meta device when transformers is installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from zeroshard.errors import ZeroshardError
from zeroshard.estimate import load_model_spec, spec_from_counts, spec_from_gpt, spec_from_hf_config, spec_from_module
from zeroshard.estimate.hf_count import count_hf_params
from zeroshard.estimate.spec import parse_count
from zeroshard.examples.gpt import GPT, GPTConfig

T0_3B = {  # bigscience/T0_3B's config.json (T5 v1.1 XL, LM-adapted), written out here: no download
    "architectures": ["T5ForConditionalGeneration"], "d_ff": 5120, "d_kv": 64, "d_model": 2048,
    "dropout_rate": 0.1, "eos_token_id": 1, "feed_forward_proj": "gated-gelu", "initializer_factor": 1.0,
    "is_encoder_decoder": True, "layer_norm_epsilon": 1e-06, "model_type": "t5", "num_decoder_layers": 24,
    "num_heads": 32, "num_layers": 24, "output_past": True, "pad_token_id": 0,
    "relative_attention_num_buckets": 32, "tie_word_embeddings": False, "vocab_size": 32128,
}
SMALL = {
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 3, "n_head": 4, "vocab_size": 1000, "n_positions": 128,
             "bos_token_id": 0, "eos_token_id": 0},
    "llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000},
    "llama-bias": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
                   "num_attention_heads": 8, "vocab_size": 1000, "attention_bias": True, "mlp_bias": True},
    "mistral": {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
                "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000},
    "qwen2": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000},
    "qwen3": {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000, "head_dim": 16},
    "t5": {"model_type": "t5", "d_model": 64, "d_ff": 128, "d_kv": 8, "num_heads": 4, "num_layers": 2,
           "num_decoder_layers": 3, "vocab_size": 1000},
}


def test_live_module_counts_tied_weights_once() -> None:
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg)
    spec = spec_from_module(model)
    assert spec.total_params == sum(p.numel() for p in model.parameters())  # parameters() dedupes
    assert spec.total_params < sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert spec.largest_layer_params == max(cfg.vocab_size * cfg.n_embd, cfg.n_embd * 4 * cfg.n_embd + 4 * cfg.n_embd)
    assert spec.live and spec.param_numels is not None and len(spec.param_numels) == len(list(model.parameters()))
    # Stage-3 units: the root plus one per block; every parameter in exactly one unit.
    assert spec.unit_params is not None and len(spec.unit_params) == 1 + cfg.n_layer
    assert sum(spec.unit_numels) == spec.total_params


def test_frozen_parameters_are_not_model_states() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 2))
    model[0].requires_grad_(False)
    assert spec_from_module(model).total_params == 22


def test_meta_device_spec_equals_the_real_model() -> None:
    real = spec_from_module(GPT(GPTConfig.preset("small")))
    meta = spec_from_gpt("small")
    assert (meta.total_params, meta.largest_layer_params, meta.param_numels) == (
        real.total_params, real.largest_layer_params, real.param_numels)


def test_an_18b_config_is_never_materialised() -> None:
    # 18.7B parameters in fp32 are 75 GB: more than this machine has. Building it for real would
    # fail; the estimator builds it on the meta device (or counts it without transformers).
    big = {"model_type": "llama", "hidden_size": 6144, "intermediate_size": 16384, "num_hidden_layers": 44,
           "num_attention_heads": 48, "num_key_value_heads": 8, "vocab_size": 128256}
    spec = spec_from_hf_config(big, "AutoModelForCausalLM")
    assert spec.total_params == 18_739_648_512
    assert spec.largest_layer_params == 128256 * 6144
    assert spec.shape is not None and spec.shape.gated_mlp


def test_builtin_counts_match_transformers() -> None:
    pytest.importorskip("transformers")  # the [hf] extra; the counts themselves are tested below
    from zeroshard.estimate.model_source import _spec_with_transformers

    for name, cfg in [*SMALL.items(), ("t0_3b", T0_3B)]:
        # T5: transformers 5 ties the LM head whatever the config says; compare the base model.
        classes = ["AutoModel"] if name in ("t0_3b", "t5") else ["AutoModel", "AutoModelForCausalLM"]
        for cls in classes:
            ours, theirs = count_hf_params(cfg, cls), _spec_with_transformers(cfg, cls)
            assert ours.total_params == theirs.total_params, (name, cls)
            assert ours.largest_layer_params == theirs.largest_layer_params, (name, cls)
            assert sorted(ours.unit_numels) == sorted(theirs.unit_numels), (name, cls)


def test_t0_3b_is_deepspeeds_2783m_model() -> None:
    spec = count_hf_params(T0_3B)
    assert (spec.total_params, spec.largest_layer_params) == (2_783_959_040, 65_798_144)
    assert spec.shape is not None and spec.shape.num_layers == 48 and spec.shape.attention_scores_stored
    # An untied LM head adds the 32128 x 2048 output matrix.
    head = count_hf_params(T0_3B, "AutoModelForSeq2SeqLM")
    assert head.total_params == spec.total_params + 32128 * 2048


def test_unknown_architecture_without_transformers_says_what_to_do() -> None:
    with pytest.raises(ZeroshardError, match=r"pip install 'zeroshard\[hf\]'.*--params"):
        count_hf_params({"model_type": "bloom", "hidden_size": 64})
    with pytest.raises(ZeroshardError, match="missing key 'num_attention_heads'"):
        count_hf_params({"model_type": "llama", "hidden_size": 64, "intermediate_size": 1, "vocab_size": 10})


def test_load_model_spec_paths(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(SMALL["llama"]))
    assert load_model_spec(str(tmp_path / "hf")).total_params == count_hf_params(SMALL["llama"]).total_params
    gpt = tmp_path / "gpt.json"
    gpt.write_text(json.dumps({"n_layer": 2, "n_embd": 32, "n_head": 2, "block_size": 16}))
    assert load_model_spec(str(gpt)).total_params == sum(
        p.numel() for p in GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)).parameters())
    assert load_model_spec("gpt:tiny").total_params == spec_from_gpt("tiny").total_params
    with pytest.raises(ZeroshardError, match="no such file"):
        load_model_spec(str(tmp_path / "missing.json"))
    with pytest.raises(ZeroshardError, match="unknown field"):
        gpt.write_text(json.dumps({"n_layers": 2}))
        load_model_spec(str(gpt))
    with pytest.raises(ZeroshardError, match="unknown GPT preset"):
        load_model_spec("gpt:huge")


def test_counts() -> None:
    assert parse_count("2.78B") == 2_780_000_000 and parse_count("65.8M") == 65_800_000
    assert parse_count("1e9") == 10**9 and parse_count("350000") == 350_000 and parse_count("4k") == 4000
    with pytest.raises(ZeroshardError, match="expected a count"):
        parse_count("lots")
    spec = spec_from_counts(3e9, 1e8)
    assert not spec.live and spec.param_numels is None and spec.unit_numels == (10**8,)
    with pytest.raises(ZeroshardError, match="largest layer"):
        spec_from_counts(10, 20)
    with pytest.raises(ZeroshardError, match="no trainable"):
        spec_from_module(nn.Identity())


def test_meta_module_is_accepted_live() -> None:
    with torch.device("meta"):
        model = nn.Linear(1000, 1000)
    spec = spec_from_module(model)
    assert spec.total_params == 1_001_000 and spec.largest_layer_params == 1_001_000
