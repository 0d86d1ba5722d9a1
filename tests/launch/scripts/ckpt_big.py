"""Launch-test worker: a 25M-parameter checkpoint for the to-fp32 memory test (torchrun).

    ckpt_big.py DIR     one fp32 AdamW step at stage 2, save_checkpoint(DIR); rank 0 also saves
                        the live module.state_dict() to DIR/live.pt for comparison
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import zeroshard
from zeroshard.examples.gpt import GPT, GPTConfig


def main(out: Path) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=8, n_head=8, n_embd=512))
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": 5_000_000}}
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    x = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(engine.rank))
    engine.backward(engine(x, x))
    engine.step()
    engine.save_checkpoint(out)
    if engine.rank == 0:
        torch.save(engine.module.state_dict(), out / "live.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
