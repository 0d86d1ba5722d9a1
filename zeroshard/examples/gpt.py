"""A small GPT (decoder-only transformer) and a character-level corpus dataset.

Used by `zeroshard train`, the tests and the benchmarks. Built from a config, never
downloaded. The output head shares its weight with the token embedding (as GPT-2 does), so the
tied-parameter paths of every ZeRO stage are exercised by the built-in example.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    """Byte-level vocabulary: every UTF-8 byte is a token, so no tokenizer is needed."""
    block_size: int = 128
    """Context length in tokens."""
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    """0 keeps runs deterministic, which the parity tests rely on."""
    tie_weights: bool = True

    @property
    def hidden_size(self) -> int:
        """The name Hugging Face configs use; zeroshard's "auto" bucket sizes read it."""
        return self.n_embd

    @classmethod
    def preset(cls, name: str) -> "GPTConfig":
        """Named sizes: "tiny" (tests), "small" (~0.8M params, the example), "25m" (bench)."""
        presets = {
            "tiny": cls(block_size=16, n_layer=2, n_head=2, n_embd=16),
            "small": cls(),
            "25m": cls(block_size=256, n_layer=8, n_head=8, n_embd=512),
        }
        if name not in presets:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(presets)}")
        return presets[name]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        # No qkv bias: the key bias has an exactly zero gradient (softmax ignores a constant
        # shift), and Adam would turn its round-off noise into full-size updates.
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """`GPT(cfg)(idx)` -> logits (B, T, vocab); `GPT(cfg)(idx, targets)` -> mean loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init for the residual projections keeps activations bounded with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def load_corpus() -> bytes:
    """The text shipped with the package (generated by tools/make_corpus.py)."""
    return resources.files("zeroshard.examples").joinpath("data/corpus.txt").read_bytes()


class CharDataset(Dataset[tuple[Tensor, Tensor]]):
    """Byte windows of `block_size + 1` tokens; sample i starts at i * stride."""

    def __init__(self, data: bytes, block_size: int, stride: int | None = None) -> None:
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.block_size = block_size
        self.stride = stride or block_size
        if len(self.tokens) <= block_size + 1:
            raise ValueError(f"corpus of {len(self.tokens)} bytes is shorter than one block")

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = i * self.stride
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]
