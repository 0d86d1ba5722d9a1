"""What the estimator knows about a model: parameter sizes and transformer shape, never weights.

A `ModelSpec` comes from a live `nn.Module` (DeepSpeed's "all live": every parameter's size, so
the flat-buffer padding of stages 1-2 is reproduced to the byte), from a config built on the
meta device (zeroshard's GPT here; a Hugging Face config in estimate/model_source.py), or
from two counts (DeepSpeed's "all cold": total parameters and the largest layer). Imports
nothing of ours but `zeroshard.errors`, `zeroshard.zero.units` (the engine's stage-3 unit rule)
and, for the built-in GPT, `zeroshard.examples.gpt`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.errors import ZeroshardError
from zeroshard.zero.units import assign_params, default_units


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """The sizes the activation estimate needs (see estimate/activations.py)."""

    hidden_size: int
    num_layers: int
    """Transformer blocks a token goes through (encoder + decoder layers for T5)."""
    num_heads: int
    vocab_size: int
    ffn_hidden_size: int
    """Inner size of the MLP (4 * hidden for GPT-2, `intermediate_size` / `d_ff` otherwise)."""
    gated_mlp: bool = False
    """SwiGLU / GeGLU MLPs keep one more ffn-sized tensor per layer."""
    max_seq_len: int | None = None
    """Longest sequence the model accepts (None: relative positions, no limit)."""
    attention_scores_stored: bool = False
    """The model materialises the s*s attention matrix (T5's position bias rules out fused
    attention kernels); False for models on torch's scaled_dot_product_attention."""
    num_kv_heads: int | None = None
    """Key/value heads under grouped-query attention (Llama-2-70B: 8 of 64); None: as many as
    `num_heads`. K and V activations shrink by num_kv_heads / num_heads."""


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Parameter sizes of a model, as the estimator needs them.

    Attributes:
        name: what the model is, for the printed tables.
        total_params: unique trainable parameter elements (tied weights once): Phi.
        largest_layer_params: elements of the module with the most parameters of its own
            (`recurse=False`), DeepSpeed's "largest layer": what stage 3 gathers at once.
        param_numels: every unique trainable parameter's size in `model.parameters()` order,
            or None for a spec built from counts (padding is then bounded, not reproduced;
            stage 3's small persistent parameters are then unknown and counted as 0).
        unit_params: for each stage-3 unit (the root, then each block of every ModuleList, as
            zero/units.py assigns them), its parameters' sizes; None when unknown.
        shape: transformer sizes for the activation estimate, when known.
        live: True when the sizes come from a module (DeepSpeed's "all live"), False for
            counts ("all cold").
    """

    name: str
    total_params: int
    largest_layer_params: int
    param_numels: tuple[int, ...] | None = None
    unit_params: tuple[tuple[int, ...], ...] | None = None
    shape: TransformerShape | None = None
    live: bool = False
    experts: Any = None
    """The model's expert banks as AutoEP cuts them (an `estimate.expert_states.ExpertSplit`), for a
    Hugging Face MoE model built from its config; None otherwise."""

    def __repr__(self) -> str:
        return (f"ModelSpec({self.name!r}, total_params={self.total_params}, "
                f"largest_layer_params={self.largest_layer_params}, live={self.live})")

    def __post_init__(self) -> None:
        if self.total_params < 1:
            raise ZeroshardError(f"{self.name}: the model has no trainable parameters")
        if not 0 <= self.largest_layer_params <= self.total_params:
            raise ZeroshardError(f"{self.name}: largest layer ({self.largest_layer_params}) must be "
                                 f"between 0 and the total ({self.total_params})")

    @property
    def unit_numels(self) -> tuple[int, ...]:
        """Elements per stage-3 unit (the largest layer alone when units are unknown)."""
        if self.unit_params is None:
            return (self.largest_layer_params,)
        return tuple(sum(u) for u in self.unit_params)


def _unique_trainable(model: nn.Module) -> list[nn.Parameter]:
    # By identity, not data_ptr(): on the meta device every tensor's data_ptr() is 0.
    return list({id(p): p for p in model.parameters() if p.requires_grad}.values())


def _units(model: nn.Module, trainable: set[int]) -> tuple[tuple[int, ...], ...]:
    """Stage-3 units as the engine forms them (zero/units.py): sizes of each unit's parameters."""
    assigned = assign_params(model, default_units(model))
    return tuple(tuple(p.numel() for _, p in assigned[i] if id(p) in trainable) for i in range(len(assigned)))


def spec_from_module(model: nn.Module, name: str | None = None,
                     shape: TransformerShape | None = None, exclude: set[int] | None = None) -> ModelSpec:
    """A spec from a live (or meta-device) module: DeepSpeed's "all live" input.

    Args:
        model: the model as it will be passed to `zeroshard.initialize`.
        name: label for the tables (default: the class name).
        shape: transformer sizes; read from `model.config` when it has one.
        exclude: ids of parameters another strategy holds (expert banks: estimate/expert_states.py).

    Example:
        >>> from torch import nn
        >>> spec_from_module(nn.Linear(4, 2)).total_params
        10
    """
    params = [p for p in _unique_trainable(model) if id(p) not in (exclude or set())]
    trainable = {id(p) for p in params}
    largest = max((sum(p.numel() for p in m.parameters(recurse=False) if id(p) in trainable)
                   for m in model.modules()), default=0)
    if shape is None and getattr(model, "config", None) is not None:
        shape = shape_from_config(model.config)
    numels = tuple(p.numel() for p in params)
    return ModelSpec(name=name or type(model).__name__, total_params=sum(numels), largest_layer_params=largest,
                     param_numels=numels, unit_params=_units(model, trainable), shape=shape, live=True)


def spec_from_counts(total_params: float, largest_layer_params: float | None = None,
                     name: str | None = None, shape: TransformerShape | None = None) -> ModelSpec:
    """A spec from counts alone: DeepSpeed's "all cold" input.

    `largest_layer_params` defaults to 0, which only matters at stage 3 (the gathered layer).
    """
    total, largest = int(total_params), int(largest_layer_params or 0)
    label = name or f"{total / 1e6:,.0f}M params"
    return ModelSpec(name=label, total_params=total, largest_layer_params=largest, shape=shape, live=False)


def _first(cfg: Any, *names: str) -> Any:
    for n in names:
        value = cfg.get(n) if isinstance(cfg, Mapping) else getattr(cfg, n, None)
        if value is not None:
            return value
    return None


def shape_from_config(cfg: Any) -> TransformerShape | None:
    """Transformer sizes from a GPTConfig, a Hugging Face config object, or its JSON dict."""
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(cfg, "num_attention_heads", "n_head", "num_heads")
    if not all(isinstance(v, int) for v in (hidden, layers, heads)):
        return None
    decoder = _first(cfg, "num_decoder_layers")
    if _first(cfg, "is_encoder_decoder") and isinstance(decoder, int):
        layers += decoder
    ffn = _first(cfg, "intermediate_size", "n_inner", "d_ff") or 4 * hidden
    act = str(_first(cfg, "feed_forward_proj", "hidden_act", "activation_function") or "")
    model_type = str(_first(cfg, "model_type") or "")
    gated = act.startswith("gated") or model_type in _GATED_TYPES
    kv = _first(cfg, "num_key_value_heads")
    return TransformerShape(num_kv_heads=kv if isinstance(kv, int) and kv != heads else None,
                            hidden_size=hidden, num_layers=layers, num_heads=heads,
                            vocab_size=int(_first(cfg, "vocab_size") or 0), ffn_hidden_size=int(ffn),
                            gated_mlp=gated, attention_scores_stored=model_type in ("t5", "mt5"),
                            max_seq_len=_first(cfg, "max_position_embeddings", "n_positions", "block_size"))


_GATED_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo"})

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)


def parse_count(text: str) -> int:
    """"2.78B" -> 2_780_000_000; "65.8M", "1e9", "350000" also work."""
    m = _SIZE.match(str(text))
    if not m:
        raise ZeroshardError(f"{text!r}: expected a count such as 2.78B, 65.8M or 1e9")
    mult = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}[m.group(2).lower()]
    return int(round(float(m.group(1)) * mult))


def _gpt_spec(gpt_cfg: Any, name: str) -> ModelSpec:
    from zeroshard.examples.gpt import GPT

    with torch.device("meta"):  # sizes only: no memory, no initialisation cost
        model = GPT(gpt_cfg)
    return spec_from_module(model, name=name, shape=shape_from_config(gpt_cfg))


def spec_from_gpt(preset_or_config: str | Mapping[str, Any]) -> ModelSpec:
    """zeroshard's built-in GPT from a preset name ("tiny", "small", "25m") or GPTConfig fields."""
    from zeroshard.examples.gpt import GPTConfig

    if isinstance(preset_or_config, str):
        try:
            cfg = GPTConfig.preset(preset_or_config)
        except ValueError as e:
            raise ZeroshardError(str(e)) from None
        return _gpt_spec(cfg, f"zeroshard GPT ({preset_or_config})")
    fields = set(GPTConfig.__dataclass_fields__)
    unknown = sorted(set(preset_or_config) - fields)
    if unknown:
        raise ZeroshardError(f"GPT config: unknown field(s) {unknown}; known: {sorted(fields)}")
    return _gpt_spec(GPTConfig(**preset_or_config), "zeroshard GPT")
