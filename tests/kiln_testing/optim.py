"""A model small enough to step optimizers by hand, with both of param_groups' groups."""

from __future__ import annotations

import torch
from torch import nn


class Small(nn.Module):
    """Matrices (decayed) and an embedding, a norm and a bias (not decayed); with `unused`, also a
    matrix that never receives a gradient, which AdamW must leave without state."""

    def __init__(self, unused: bool = False):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.norm = nn.LayerNorm(6)
        self.proj = nn.Linear(6, 5)
        self.head = nn.Linear(5, 11, bias=False)
        if unused:
            self.unused = nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        return self.head(self.proj(self.norm(self.emb(x))))
