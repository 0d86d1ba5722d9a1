"""Resolve a model description to a `ModelSpec`: the CLI's `--model` (a zeroshard GPT preset, a
GPT config JSON, a Hugging Face config.json or its directory) and Hugging Face configs, built on
the meta device with `transformers`, or counted by estimate/hf_count.py without it.

Imports nothing of ours but `zeroshard.errors`, `estimate.spec`, `estimate.hf_count` and
`estimate.expert_states` (it sits above them, so none imports it back); `transformers` only inside functions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from zeroshard.errors import ZeroshardError
from zeroshard.estimate.expert_states import split_experts
from zeroshard.estimate.hf_count import count_hf_params
from zeroshard.estimate.spec import ModelSpec, shape_from_config, spec_from_gpt, spec_from_module


def spec_from_hf_config(config: Mapping[str, Any], hf_class: str = "AutoModel") -> ModelSpec:
    """A Hugging Face config (its config.json as a dict), built on the meta device.

    With `transformers` installed the model is instantiated on the meta device (no memory, no
    weights) with `hf_class` ("AutoModel", as DeepSpeed's example does, or e.g.
    "AutoModelForCausalLM"). Without it, a built-in count covers GPT-2, the Llama family and T5
    (see estimate/hf_count.py); other architectures need `pip install zeroshard[hf]` or counts.
    """
    try:
        import transformers  # noqa: F401  (optional extra [hf])
    except ImportError:
        return count_hf_params(config, hf_class)
    return _spec_with_transformers(config, hf_class)


def _spec_with_transformers(config: Mapping[str, Any], hf_class: str) -> ModelSpec:
    import transformers

    raw = dict(config)
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise ZeroshardError("Hugging Face config: no \"model_type\" key; is this a config.json?")
    cls = getattr(transformers, hf_class, None)
    if cls is None or not hasattr(cls, "from_config"):
        raise ZeroshardError(f"--hf-class {hf_class}: not a transformers Auto class (e.g. AutoModel, "
                             "AutoModelForCausalLM, AutoModelForSeq2SeqLM)")
    hf_cfg = transformers.AutoConfig.for_model(model_type, **raw)
    with torch.device("meta"):
        model = cls.from_config(hf_cfg)
    name = f"{type(model).__name__} ({model_type})"
    shape = shape_from_config(hf_cfg)
    return replace(spec_from_module(model, name=name, shape=shape), experts=split_experts(model, name, shape))


def load_model_spec(model: str, hf_class: str = "AutoModel") -> ModelSpec:
    """Resolve the CLI's `--model`: "gpt:<preset>", a GPT config JSON, or a HF config.json/dir.

    Raises:
        ZeroshardError: the file does not exist or is neither kind of config.
    """
    if model.startswith("gpt:"):
        return spec_from_gpt(model[4:])
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ZeroshardError(f"--model {model}: no such file; give gpt:<tiny|small|25m>, a Hugging Face "
                             "config.json (or its directory), or use --params/--largest-layer")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ZeroshardError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ZeroshardError(f"{path}: expected a JSON object")
    if "model_type" in raw:
        return spec_from_hf_config(raw, hf_class)
    return replace(spec_from_gpt(raw), name=f"zeroshard GPT ({path.name})")
