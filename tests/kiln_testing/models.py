"""Model wrappers shared by the tests."""

from __future__ import annotations

import torch


class ForcesToken(torch.nn.Module):
    """The model, but `token` is forced as the prediction at position `at` (and, with `onward`, at
    every later position too, so a request that stops on that token stops there). It counts positions,
    not calls, so it holds however a server batches and caches the requests."""

    def __init__(self, inner, token: int, at: int, onward: bool = True):
        super().__init__()
        self.inner, self.cfg, self.token, self.at, self.onward = inner, inner.cfg, token, at, onward

    def forward(self, tokens, kv_cache=None, **kwargs):
        before = torch.tensor(kv_cache.lengths if kv_cache is not None else [0] * tokens.shape[0])
        logits = self.inner(tokens, kv_cache=kv_cache, **kwargs)
        predicted = before[:, None] + torch.arange(tokens.shape[1]) + 1  # position each logit predicts
        hit = predicted >= self.at if self.onward else predicted == self.at
        logits[..., self.token] += hit.to(logits.dtype) * 1000.0
        return logits
