"""The tiny layers the pipeline tests build their models from (tests/dist/test_pipeline.py, test_3d.py,
and the DeepSpeed workers in tests/differential, which put tests/dist on sys.path): one definition, so
zeroshard's and DeepSpeed's runs and the one-process references build the very same modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim) * 0.5)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.norm(x))
