"""ZeRO inference at stage 3: generation on N ranks with different prompts and lengths, a
transformers model built from its config, and the 16-bit model export; a frozen model at stage 0."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import assert_params_close, gathered_snapshot, global_batches, init_engine, make_config, make_model

import zeroshard
from zeroshard.examples.gpt import GPT

STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 100}


def greedy(model: torch.nn.Module, idx: torch.Tensor, n: int) -> torch.Tensor:
    """The single-process reference: plain greedy decoding with the whole model."""
    with torch.no_grad():
        for _ in range(n):
            nxt = model(idx[:, -model.config.block_size:])[:, -1, :].argmax(-1)
            idx = torch.cat([idx, nxt[:, None]], dim=1)
    return idx


@pytest.mark.parametrize("offload", [{}, {"offload_param": {"device": "cpu"}}], ids=["plain", "offload-param"])
def test_generation_matches_one_process_with_uneven_lengths(groups, offload: dict) -> None:
    model = make_model()
    reference = copy.deepcopy(model).eval()
    # Inference only: no optimizer and no model_parameters (an optimizer-less engine with
    # model_parameters= is refused: that asks for training).
    engine, *_ = zeroshard.initialize(model=model, config=make_config(
        optimizer=None, zero_optimization={**STAGE3, **offload}))
    g = torch.Generator().manual_seed(100 + groups.rank)  # each rank its own prompts
    prompt = torch.randint(0, 256, (2, 5), generator=g)
    n = 2 + 3 * groups.rank  # each rank its own output length: ranks finish at different steps
    out = engine.generate(prompt, max_new_tokens=n, block_size=model.config.block_size)
    assert out.shape == (2, 5 + n)
    assert torch.equal(out, greedy(reference, prompt, n))


def test_frozen_model_at_stage0_is_an_inference_engine(groups) -> None:
    """TRL's `prepare_deepspeed` (LLaMA-Factory's DPO at ZeRO 0-2) hands its reference model, every
    parameter frozen, to deepspeed.initialize with stage 0 and no optimizer; DeepSpeed 0.19.8 gives an
    engine for inference (at stage 2 it refuses: "requires an optimizer"). Before, zeroshard refused
    stage 0 too ("the model has no trainable parameters")."""
    model = make_model()
    for p in model.parameters():
        p.requires_grad_(False)
    reference = copy.deepcopy(model).eval()
    engine, optimizer, *_ = zeroshard.initialize(model=model, config=make_config(
        optimizer=None, zero_optimization={"stage": 0}))
    engine.eval()
    x = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(groups.rank))
    with torch.no_grad():
        assert torch.equal(engine(x), reference(x))
    assert optimizer is None
    with pytest.raises(ValueError, match="no trainable parameters"):
        zeroshard.initialize(model=copy.deepcopy(reference), config=make_config(
            optimizer=None, zero_optimization={"stage": 2}))


def test_transformers_model_trains_and_generates(groups) -> None:
    transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg)
    batches = global_batches(4, 2 * groups.world_size)
    trained = []
    for zero in ({"stage": 0}, STAGE3):
        zero = {**zero, "reduce_bucket_size": "auto"}  # resolved from config.hidden_size: 32 * 32
        engine = init_engine(copy.deepcopy(base), make_config(zero_optimization=zero))
        assert engine.zs_config.zero_optimization.reduce_bucket_size == 32 * 32
        for x, _ in batches:
            r = groups.rank
            ids = (x[2 * r : 2 * r + 2] % 128)
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            engine.step()
        trained.append(gathered_snapshot(engine.module))
    assert_params_close(trained[1], trained[0], 1e-5, "llama stage 3 vs stage 0")
    # generate with different lengths per rank, against the stage-0-trained copy on one process
    reference = copy.deepcopy(base)
    reference.load_state_dict({k: v for k, v in zip([n for n, _ in base.named_parameters()], trained[0])},
                              strict=False)
    prompt = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(groups.rank))
    n = 2 + 2 * groups.rank
    got = engine.generate(input_ids=prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    want = reference.eval().generate(input_ids=prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    assert torch.equal(got, want)


def test_save_16bit_model(groups, tmp_path_factory) -> None:
    directory = tmp_path_factory.mktemp("export")
    model = make_model()
    cfg = make_config(bf16={"enabled": True}, zero_optimization=STAGE3)
    engine = init_engine(model, cfg)
    assert engine.save_16bit_model(directory) is False, "stage 3 needs the gather flag"
    cfg["zero_optimization"] = {**STAGE3, "stage3_gather_16bit_weights_on_model_save": True}
    engine = init_engine(make_model(), cfg)
    x, y = global_batches(1, 2)[0]
    engine.backward(engine(x, y))
    engine.step()
    assert engine.save_16bit_model(directory)
    want = dict(zip([n for n, _ in engine.module.named_parameters()], gathered_snapshot(engine.module)))
    if groups.rank == 0:
        saved = torch.load(directory / "pytorch_model.bin")
        head, wte = saved["lm_head.weight"], saved["wte.weight"]
        assert head is wte or torch.equal(head, wte)
        for name, value in want.items():
            assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name].float(), value), name
        # The file is a usable checkpoint: a fresh model loads it with every key accounted for.
        fresh = GPT(engine.module.config).to(torch.bfloat16)
        fresh.load_state_dict(saved, strict=True)
        assert all(torch.equal(p.float(), want[n]) for n, p in fresh.named_parameters())
