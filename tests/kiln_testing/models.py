"""Model wrappers and weight fills shared by the tests."""

from __future__ import annotations

import threading

import torch


class Scripted(torch.nn.Module):
    """A real model whose every forward call is pushed hard towards the next token of a script, so
    generation yields a chosen text: forward call k (the prefill being 0) yields script[k], and
    every call after the script's end yields its last token."""

    def __init__(self, inner, script):
        super().__init__()
        self.inner, self.cfg, self.script, self.calls = inner, inner.cfg, script, 0

    def forward(self, tokens, **kwargs):
        logits = self.inner(tokens, **kwargs)
        logits[..., self.script[min(self.calls, len(self.script) - 1)]] += 1000.0
        self.calls += 1
        return logits


class Gate(torch.nn.Module):
    """The model, but forward call number `hold` waits until the test opens the gate: the test can
    act while a request is known to be mid-generation (and a request it sends meanwhile surely
    joins the running batch), without timing."""

    def __init__(self, inner, hold: int):
        super().__init__()
        self.inner, self.cfg, self.hold, self.calls = inner, inner.cfg, hold, 0
        self.reached, self.open = threading.Event(), threading.Event()

    def forward(self, tokens, **kwargs):
        self.calls += 1
        if self.calls == self.hold:
            self.reached.set()
            assert self.open.wait(60), "the test never opened the gate"
        return self.inner(tokens, **kwargs)


class ForcesToken(torch.nn.Module):
    """The model, but `token` is forced as the prediction at position `at` (and, with `onward`, at
    every later position too, so a request that stops on that token stops there). Unlike Scripted it
    counts positions, not calls, so it holds however a server batches and caches the requests."""

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


@torch.no_grad()
def randomise(model, std=0.1):
    """Random weights everywhere, norms included (near 1), so a swapped or transposed tensor cannot
    hide behind a zero or an identity. Draws from torch's global generator; returns the model."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.uniform_(0.5, 1.5)
        else:
            p.normal_(0, std)
    return model
