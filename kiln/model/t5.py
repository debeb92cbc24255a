"""The T5 encoder-decoder (Raffel et al. 2020, v1.1 options): one readable file, no parallelism inside.

    encoder:  x = x + self_attn(norm(x), bidirectional bucket bias + padding mask);  x = x + ffn(norm(x))
    decoder:  x = x + self_attn(norm(x), causal bucket bias);  x = x + cross_attn(norm(x), encoder output)
              x = x + ffn(norm(x));  logits = norm(x) [* dim**-0.5] @ embedding^T

What differs from the decoder-only Transformer beside it:
- Positions enter only as a learned scalar per (head, distance bucket) added to the attention scores;
  each stack owns one table and every layer of that stack adds the same bias. Distances below half
  the buckets get a bucket each, longer ones share log-spaced buckets up to rel_max_distance.
- Scores are not divided by sqrt(head_dim): T5 folds that factor into the initialisation of q.
- One embedding matrix serves the encoder, the decoder and the output head.
Parameter names map one-to-one onto transformers' T5ForConditionalGeneration (kiln/hf_t5.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.model.norm import RMSNorm, _compute_dtype
from kiln.model.t5_config import T5Config


def relative_position_bucket(
    relative: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Bucket of each key position minus query position (T5 paper, sec. 2.1). Bidirectional: half the
    buckets for keys after the query, half for keys before. Causal: keys after the query are masked
    anyway and share bucket 0 with distance 0."""
    offset = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        offset = (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    exact = num_buckets // 2
    # The same float32 expression transformers evaluates, so a distance on a bucket boundary rounds
    # to the same bucket; clamp(min=1) only keeps log(0) out of the branch `where` discards.
    scaled = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    far = (exact + (scaled * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return offset + torch.where(distance < exact, distance, far)


def masked_bias(bias: torch.Tensor, allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask: bias where allowed, the dtype's lowest value elsewhere (not -inf,
    so a row with every key masked gives a uniform softmax instead of NaN, as in transformers)."""
    bias = bias.to(dtype)
    if allowed is None:
        return bias
    return bias.masked_fill(~allowed, torch.finfo(dtype).min)


class T5Attention(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.q = nn.Linear(cfg.dim, cfg.inner_dim, bias=False)
        self.k = nn.Linear(cfg.dim, cfg.inner_dim, bias=False)
        self.v = nn.Linear(cfg.dim, cfg.inner_dim, bias=False)
        self.o = nn.Linear(cfg.inner_dim, cfg.dim, bias=False)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.n_heads, self.head_dim)).transpose(1, 2)  # [B, H, T, hd]

    def project_kv(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(self.k(source)), self.heads(self.v(source))

    def forward(self, x, bias, source=None, *, kv=None, kv_cache=None) -> torch.Tensor:
        """x [B, T, dim] attends to source (default x) or to precomputed kv; bias [B|1, H|1, T, S]
        is added to the scores. kv_cache (self-attention at inference) stores the new keys and
        values and returns every cached one."""
        q = self.heads(self.q(x))
        k, v = kv if kv is not None else self.project_kv(x if source is None else source)
        if kv_cache is not None:
            k, v, _ = kv_cache.update(k, v)  # the bias carries the mask, so the cache's masking is unused
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        return self.o(out.transpose(1, 2).flatten(2))


class T5FeedForward(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.gated = cfg.ffn == "gated-gelu"
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        if self.gated:
            self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:  # v1.1: the tanh-approximated GELU (transformers' gelu_new)
            return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))
        return self.w2(F.relu(self.w1(x)))


class T5Block(nn.Module):
    def __init__(self, cfg: T5Config, decoder: bool):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = T5Attention(cfg)
        if decoder:
            self.cross_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
            self.cross = T5Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.ffn = T5FeedForward(cfg)

    def forward(self, x, bias, memory=None, cross_bias=None, *, cross_kv=None, kv_cache=None):
        x = x + self.attn(self.attn_norm(x), bias, kv_cache=kv_cache)
        if hasattr(self, "cross"):
            x = x + self.cross(self.cross_norm(x), cross_bias, memory, kv=cross_kv)
        return x + self.ffn(self.ffn_norm(x))


class T5Stack(nn.Module):
    """The encoder (bidirectional) or the decoder (causal, with cross-attention) of T5."""

    def __init__(self, cfg: T5Config, n_layers: int, decoder: bool):
        super().__init__()
        self.cfg, self.decoder = cfg, decoder
        self.rel_bias = nn.Embedding(cfg.rel_buckets, cfg.n_heads)
        self.layers = nn.ModuleList(T5Block(cfg, decoder) for _ in range(n_layers))
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)

    def position_bias(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """query_pos [B|1, T], key_pos [S] -> [B|1, H, T, S], shared by every layer of the stack."""
        relative = key_pos[None, None, :] - query_pos[:, :, None]
        buckets = relative_position_bucket(relative, not self.decoder, self.cfg.rel_buckets, self.cfg.rel_max_distance)
        return self.rel_bias(buckets).permute(0, 3, 1, 2)


class T5(nn.Module):
    encoder_decoder = True  # the engine encodes the prompt once and decodes from the start token

    def __init__(self, cfg: T5Config):
        super().__init__()
        cfg.validate()
        if cfg.vocab_size <= 0:
            raise ConfigError("vocab_size", f"must be set (> 0) before building a model, got {cfg.vocab_size}")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.encoder = T5Stack(cfg, cfg.n_layers, decoder=False)
        self.decoder = T5Stack(cfg, cfg.decoder_layers, decoder=True)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """T5's initialisation (Mesh TensorFlow's, as transformers has it): unit-variance embeddings,
        every projection at 1/sqrt(fan_in), and q also by 1/sqrt(head_dim), standing in for the score
        scaling T5 leaves out. Deterministic under torch.manual_seed."""
        cfg, f = self.cfg, self.cfg.init_factor
        nn.init.normal_(self.embed.weight, std=f)
        for stack in (self.encoder, self.decoder):
            nn.init.normal_(stack.rel_bias.weight, std=f * cfg.dim**-0.5)
            stack.norm.reset_parameters()
            for block in stack.layers:
                for attn in (block.attn, getattr(block, "cross", None)):
                    if attn is None:
                        continue
                    nn.init.normal_(attn.q.weight, std=f * (cfg.dim * cfg.head_dim) ** -0.5)
                    nn.init.normal_(attn.k.weight, std=f * cfg.dim**-0.5)
                    nn.init.normal_(attn.v.weight, std=f * cfg.dim**-0.5)
                    nn.init.normal_(attn.o.weight, std=f * cfg.inner_dim**-0.5)
                for module in block.modules():
                    if isinstance(module, RMSNorm):
                        module.reset_parameters()
                for w in (block.ffn.w1, getattr(block.ffn, "w3", None)):
                    if w is not None:
                        nn.init.normal_(w.weight, std=f * cfg.dim**-0.5)
                nn.init.normal_(block.ffn.w2.weight, std=f * cfg.ffn_hidden**-0.5)

    def _check_length(self, tokens: torch.Tensor, what: str) -> None:
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"{what} length {tokens.shape[1]} exceeds model max_seq_len={self.cfg.max_seq_len}")

    def encode(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, S] -> encoder output [B, S, dim]; mask [B, S] (1 = real token) hides padding keys."""
        self._check_length(tokens, "encoder input")
        x = self.embed(tokens)
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        allowed = None if mask is None else mask.bool()[:, None, None, :]
        bias = masked_bias(self.encoder.position_bias(pos[None], pos), allowed, _compute_dtype(x))
        for block in self.encoder.layers:
            x = block(x, bias)
        return self.encoder.norm(x)

    def cross_kv(self, memory: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every decoder layer's cross-attention keys and values of an encoder output: computed once
        per prompt at inference, since the encoder output does not change while decoding."""
        return [block.cross.project_kv(memory) for block in self.decoder.layers]

    def decode(
        self,
        tokens: torch.Tensor,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        kv_cache=None,
    ) -> torch.Tensor:
        """Decoder tokens [B, T] -> logits [B, T, vocab], attending to the encoder output memory
        [B, S, dim] (masked by memory_mask [B, S]) and causally to themselves (mask [B, T] hides
        padding). kv_cache (kiln.infer.seq2seq.Seq2SeqCache): tokens follow each row's cached ones,
        and the cross-attention keys, values and memory mask come from the cache instead."""
        self._check_length(tokens, "decoder input")
        seq = tokens.shape[1]
        x = self.embed(tokens)
        dtype = _compute_dtype(x)
        if kv_cache is not None:
            width = max(kv_cache.lengths) + seq
            query_pos = kv_cache.prepare(seq)  # [B, T]: each row's own positions
            key_pos = torch.arange(width, device=tokens.device)
            allowed = (key_pos <= query_pos[:, :, None])[:, None]  # slots past a row's length stay hidden
            memory_mask = kv_cache.memory_mask
        else:
            key_pos = torch.arange(seq, device=tokens.device)
            query_pos = key_pos[None]
            allowed = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).tril()[None, None]
            if mask is not None:
                allowed = allowed & mask.bool()[:, None, None, :]
        bias = masked_bias(self.decoder.position_bias(query_pos, key_pos), allowed, dtype)
        cross_bias = None
        if memory_mask is not None:
            zeros = torch.zeros(memory_mask.shape[0], 1, 1, memory_mask.shape[1], device=x.device)
            cross_bias = masked_bias(zeros, memory_mask.bool()[:, None, None, :], dtype)
        for i, block in enumerate(self.decoder.layers):
            if kv_cache is not None:
                x = block(x, bias, cross_bias=cross_bias, cross_kv=kv_cache.cross(i), kv_cache=kv_cache.layer(i))
            else:
                x = block(x, bias, memory, cross_bias)
        if kv_cache is not None:
            kv_cache.advance(seq)
        x = self.decoder.norm(x)
        if self.cfg.scale_logits:
            x = x * self.cfg.dim**-0.5
        return F.linear(x, self.embed.weight)

    def forward(
        self,
        tokens: torch.Tensor,
        decoder_tokens: torch.Tensor,
        mask: torch.Tensor | None = None,
        decoder_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Encoder tokens [B, S] and decoder tokens [B, T] (the targets shifted right behind the start
        token pad_id) -> logits [B, T, vocab]. mask / decoder_mask [B, S] / [B, T]: 1 = real token."""
        return self.decode(decoder_tokens, self.encode(tokens, mask), mask, decoder_mask)


def count_params(model_or_cfg, non_embedding: bool = False, active: bool = False) -> int:
    """Parameters of a T5 (or of its config); non_embedding leaves out the shared embedding (= head).
    Dense: every parameter is active, so `active` changes nothing."""
    cfg = getattr(model_or_cfg, "cfg", model_or_cfg)
    attn = 4 * cfg.dim * cfg.inner_dim
    ffn = (3 if cfg.ffn == "gated-gelu" else 2) * cfg.dim * cfg.ffn_hidden
    encoder = cfg.n_layers * (attn + ffn + 2 * cfg.dim)
    decoder = cfg.decoder_layers * (2 * attn + ffn + 3 * cfg.dim)
    total = encoder + decoder + 2 * (cfg.rel_buckets * cfg.n_heads + cfg.dim)
    return total if non_embedding else total + cfg.vocab_size * cfg.dim


def flops_per_token(cfg: T5Config, seq_len: int) -> float:
    """Training FLOPs of one encoder position plus one decoder position (6 per weight each, as the
    decoder's flops_per_token counts; the head is a dim x vocab matmul), with the attention scores
    at seq_len keys: self-attention in both stacks and cross-attention in the decoder."""
    n = count_params(cfg, non_embedding=True) + cfg.vocab_size * cfg.dim
    attention_layers = cfg.n_layers + 2 * cfg.decoder_layers
    return 6.0 * n + 12.0 * attention_layers * cfg.inner_dim * seq_len
