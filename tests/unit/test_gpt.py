"""The built-in example model and dataset."""

from __future__ import annotations

import torch

from zeroshard.examples.gpt import GPT, CharDataset, GPTConfig, load_corpus


def test_gpt_ties_head_to_embedding_and_learns() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig.preset("tiny")
    model = GPT(cfg)
    assert model.lm_head.weight is model.wte.weight
    assert model.config.hidden_size == cfg.n_embd
    data = CharDataset(load_corpus()[:4000], cfg.block_size)
    x, y = map(torch.stack, zip(*[data[i] for i in range(8)]))
    assert torch.equal(x[:, 1:], y[:, :-1])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss = model(x, y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.8 * first
    assert model(x).shape == (8, cfg.block_size, cfg.vocab_size)


def test_corpus_is_shipped() -> None:
    text = load_corpus()
    assert len(text) > 100_000 and text.decode("utf-8").count(".") > 1000
