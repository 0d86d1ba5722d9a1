"""Parameter sizes of common Hugging Face architectures from config.json, without transformers.

Used only when the optional `transformers` package is absent (with it, the model is built on
the meta device instead). Covers GPT-2, the Llama family (llama, mistral, qwen2, qwen3) and T5;
tests/unit/test_estimate_spec.py checks each count against transformers when it is installed.
The counts follow the modelling code: the parameters each module registers, tied weights once.
Imports only `zeroshard.errors` and `estimate.spec`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from zeroshard.errors import ZeroshardError
from zeroshard.estimate.spec import ModelSpec, shape_from_config

Unit = list[int]
"""The parameter sizes of one module group (a block, or the root's own parameters)."""

_HEAD_CLASSES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelWithLMHead")


def _get(cfg: Mapping[str, Any], key: str, default: Any) -> Any:
    value = cfg.get(key)
    return default if value is None else value


def _gpt2(cfg: Mapping[str, Any], head: bool) -> tuple[Unit, list[Unit], Unit]:
    h, v, p = cfg["n_embd"], cfg["vocab_size"], _get(cfg, "n_positions", 1024)
    inner = _get(cfg, "n_inner", 4 * h)
    block = [h, h, h * 3 * h, 3 * h, h * h, h, h, h, h * inner, inner, inner * h, h]
    tied = _get(cfg, "tie_word_embeddings", True)
    root = [v * h, p * h]
    return root, [list(block) for _ in range(cfg["n_layer"])], [h, h] + ([] if tied or not head else [v * h])


def _llama(cfg: Mapping[str, Any], head: bool) -> tuple[Unit, list[Unit], Unit]:
    model_type = cfg["model_type"]
    h, v, inner = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv = _get(cfg, "num_key_value_heads", heads)
    hd = _get(cfg, "head_dim", h // heads)
    qkv_bias = model_type == "qwen2" or bool(_get(cfg, "attention_bias", False))
    o_bias = model_type != "qwen2" and bool(_get(cfg, "attention_bias", False))
    mlp_bias = bool(_get(cfg, "mlp_bias", False))
    attn = [h * heads * hd, h * kv * hd, h * kv * hd, heads * hd * h]
    attn += [heads * hd, kv * hd, kv * hd] if qkv_bias else []
    attn += [h] if o_bias else []
    attn += [hd, hd] if model_type == "qwen3" else []  # q_norm, k_norm
    mlp = [h * inner, h * inner, inner * h] + ([inner, inner, h] if mlp_bias else [])
    block = attn + mlp + [h, h]
    tied = _get(cfg, "tie_word_embeddings", False)
    tail = [h] + ([] if tied or not head else [v * h])
    return [v * h], [list(block) for _ in range(cfg["num_hidden_layers"])], tail


def _t5(cfg: Mapping[str, Any], head: bool) -> tuple[Unit, list[Unit], Unit]:
    d, v, ff = cfg["d_model"], cfg["vocab_size"], cfg["d_ff"]
    heads, d_kv = cfg["num_heads"], cfg["d_kv"]
    inner, buckets = heads * d_kv, _get(cfg, "relative_attention_num_buckets", 32)
    gated = str(_get(cfg, "feed_forward_proj", "relu")).startswith("gated")
    attn = [d * inner, d * inner, d * inner, inner * d]
    ffn = ([d * ff, d * ff] if gated else [d * ff]) + [ff * d]
    enc_layers = cfg["num_layers"]
    dec_layers = _get(cfg, "num_decoder_layers", enc_layers)
    # zero/units.py makes every ModuleList child a unit: each T5Block (no parameters of its
    # own) and each of its sub-layers (self-attention, cross-attention, feed-forward).
    blocks: list[Unit] = []
    for i in range(enc_layers):
        blocks += [[], attn + ([buckets * heads] if i == 0 else []) + [d], ffn + [d]]
    for i in range(dec_layers):
        blocks += [[], attn + ([buckets * heads] if i == 0 else []) + [d], attn + [d], ffn + [d]]
    tied = _get(cfg, "tie_word_embeddings", True)
    tail = [d, d] + ([] if tied or not head else [v * d])  # encoder and decoder final norms
    return [v * d], blocks, tail


_COUNTERS: dict[str, Callable[[Mapping[str, Any], bool], tuple[Unit, list[Unit], Unit]]] = {
    "gpt2": _gpt2, "llama": _llama, "mistral": _llama, "qwen2": _llama, "qwen3": _llama, "t5": _t5,
}


def count_hf_params(config: Mapping[str, Any], hf_class: str = "AutoModel") -> ModelSpec:
    """A `ModelSpec` for a Hugging Face config.json without building anything.

    Args:
        config: the config.json contents.
        hf_class: "AutoModel" counts the base model (DeepSpeed's example); an LM class
            ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM") adds the output head when the
            config does not tie it to the input embedding.

    Raises:
        ZeroshardError: an architecture without a built-in count, or a missing key.
    """
    model_type = str(config.get("model_type"))
    counter = _COUNTERS.get(model_type)
    if counter is None:
        raise ZeroshardError(
            f"model_type {model_type!r}: no built-in parameter count (have: {', '.join(sorted(_COUNTERS))}). "
            "Install the optional extra (pip install 'zeroshard[hf]') to build any transformers model on "
            "the meta device, or pass --params and --largest-layer.")
    if hf_class != "AutoModel" and hf_class not in _HEAD_CLASSES:
        raise ZeroshardError(f"--hf-class {hf_class}: without transformers only AutoModel and "
                             f"{', '.join(_HEAD_CLASSES)} are understood")
    try:
        root, blocks, tail = counter(config, hf_class != "AutoModel")
    except KeyError as e:
        raise ZeroshardError(f"{model_type} config: missing key {e}") from None
    numels = [*root, *(n for b in blocks for n in b), *tail]
    largest = max(max(root + tail), max(_layer_sizes(model_type, b) for b in blocks if b))
    return ModelSpec(name=f"{model_type} ({hf_class}, built-in count)", total_params=sum(numels),
                     largest_layer_params=largest, param_numels=tuple(numels),
                     unit_params=(tuple(root + tail), *(tuple(b) for b in blocks)),
                     shape=shape_from_config(config), live=False)


def _layer_sizes(model_type: str, block: Unit) -> int:
    """Largest module's own parameters within a block (weight + bias live in one module)."""
    if model_type == "gpt2":
        # Conv1D modules own weight and bias: c_attn, c_proj, c_fc, mlp c_proj.
        return max(block[2] + block[3], block[4] + block[5], block[8] + block[9], block[10] + block[11])
    return max(block)
