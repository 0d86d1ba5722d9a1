"""Generation on N ranks that never hangs, for stage 3 (and every other stage).

At stage 3 each forward is collective (units are all-gathered), so every rank must run the
same number of forwards even when its own sequences finish early: a finished rank keeps
stepping on its last tokens, discarding the result, until every rank is done (the
`synced_gpus` rule of Hugging Face's `generate`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from zeroshard.zero.init import GatheredParameters
from zeroshard.zero.units import ZeroParameter

if TYPE_CHECKING:
    from zeroshard.runtime.engine_api import EngineView


@torch.no_grad()
def generate_tokens(engine: "EngineView", input_ids: Tensor, max_new_tokens: int,
                    eos_token_id: int | None = None, block_size: int | None = None) -> Tensor:
    """Greedy decoding with a model whose forward maps token ids (B, T) to logits (B, T, V).

    Args:
        engine: the engine wrapping the model (any stage).
        input_ids: this rank's prompts, (B, T).
        max_new_tokens: tokens to add on this rank; may differ between ranks.
        eos_token_id: stop a sequence at this token (it is kept in the output).
        block_size: the model's context length; longer inputs are cropped to their last tokens.

    Returns:
        (B, T + n) with n <= max_new_tokens; every rank returns when all ranks are done.
    """
    idx = input_ids
    finished = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
    steps = 0
    while True:
        mine_done = steps >= max_new_tokens or bool(finished.all())
        flag = torch.tensor([0.0 if mine_done else 1.0], device=engine.device)
        engine.comm.all_reduce(flag, op="max")  # any rank still generating?
        if flag.item() == 0.0:
            return idx
        context = idx if block_size is None else idx[:, -block_size:]
        logits = engine(context)
        if mine_done:
            continue  # keep the collectives of this forward paired with the other ranks'
        next_token = logits[:, -1, :].float().argmax(dim=-1)
        if eos_token_id is not None:
            next_token = torch.where(finished, torch.full_like(next_token, eos_token_id), next_token)
            finished |= next_token == eos_token_id
        idx = torch.cat([idx, next_token[:, None]], dim=1)
        steps += 1


def hf_generate(engine: "EngineView", **kwargs: Any) -> Any:
    """`model.generate(**kwargs)` of a Hugging Face model, with `synced_gpus` on when the
    ranks must step together (world size > 1): ranks may then ask for different lengths."""
    if engine.world_size > 1:
        kwargs.setdefault("synced_gpus", True)
    return engine.module.generate(**kwargs)


@contextmanager
def unwrap_model_for_generation(model: Any, accelerator: Any = None,
                                gather_deepspeed3_params: bool = True) -> Iterator[nn.Module]:
    """Yield the plain model to generate with, its stage-3 parameters gathered for the block.

    TRL's helper of this name, for an engine or a module: `model` may be a ZeroEngine (its
    `.module` is yielded) or the module itself; `accelerator` is accepted and unused. With
    `gather_deepspeed3_params` every partitioned parameter is gathered on entry (collective:
    every rank enters together) and released on exit, so `model.generate(...)` runs without
    one gather per forward; False yields the module as it is (each forward then gathers, which
    needs every rank to run the same number of forwards: `synced_gpus=True`).

    Example::

        with unwrap_model_for_generation(engine) as m:
            out = m.generate(input_ids, max_new_tokens=20)
    """
    module = getattr(model, "module", model)
    partitioned = [p for p in module.parameters() if isinstance(p, ZeroParameter)]
    if not gather_deepspeed3_params or not partitioned:
        yield module
        return
    with GatheredParameters(partitioned):
        yield module
