"""A position-wise language model in float64 (test helper): samples packed into one stream cannot
interact (as with slime's varlen attention), and every parameter sits in a layer with a per-sample
gradient rule (embedding, LayerNorm, linear with bias, linear head)."""

from __future__ import annotations

import torch
from torch import nn


class TokenwiseLM(nn.Module):
    def __init__(self, seed: int, vocab: int, d: int, h: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.head = nn.Linear(h, vocab, bias=False)
        self.double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [1, T] -> [1, T, V]
        return self.head(torch.tanh(self.up(self.norm(self.embed(tokens)))))
