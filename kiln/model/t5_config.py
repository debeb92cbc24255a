"""Shape and options of the T5 encoder-decoder (kiln/model/t5.py). Torch-free: recipes import it.

The layout is T5 v1.1 as transformers 5 implements it: no biases, T5's scale-only norm, relative
position buckets shared by the layers of each stack, and one embedding matrix shared by the encoder,
the decoder and the output head (transformers 5 always ties the head; `scale_logits` is the one
choice left, the d_model**-0.5 rescaling the original T5 applies before its tied head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.errors import ConfigError

T5_FFNS = ("gated-gelu", "relu")  # T5 v1.1 and the original T5


@dataclass
class T5Config:
    arch: str = "t5"
    vocab_size: int = 0  # 0: take the trained tokenizer's size
    dim: int = 256  # d_model
    n_heads: int = 4
    head_dim: int = 64  # d_kv: T5 does not tie it to dim / n_heads
    ffn_hidden: int = 512  # d_ff
    ffn: str = "gated-gelu"  # gated-gelu (v1.1: gelu(x W1) * x W3) | relu (original T5)
    n_layers: int = 4  # encoder blocks
    n_decoder_layers: int = 0  # 0: as many as the encoder
    rel_buckets: int = 32  # relative_attention_num_buckets
    rel_max_distance: int = 128  # distances beyond this share the last bucket
    norm_eps: float = 1e-6
    scale_logits: bool = True  # decoder output * dim**-0.5 before the tied head
    max_seq_len: int = 512  # longest encoder input and decoder output Kiln accepts
    pad_id: int = 1  # Kiln's <|pad|>; also the decoder's start token, as in T5
    eos_id: int = 0  # Kiln's <|endoftext|>: ends every target and generated sequence
    init_factor: float = 1.0  # T5's initializer_factor: every init std is scaled by it

    @property
    def decoder_layers(self) -> int:
        return self.n_decoder_layers or self.n_layers

    @property
    def inner_dim(self) -> int:
        return self.n_heads * self.head_dim

    def validate(self) -> None:
        if self.arch != "t5":
            raise ConfigError("arch", f"a T5Config has arch = 't5', got {self.arch!r}")
        for key in ("dim", "n_heads", "head_dim", "ffn_hidden", "n_layers", "rel_buckets", "max_seq_len"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, f"must be positive, got {getattr(self, key)}")
        for key in ("vocab_size", "n_decoder_layers", "pad_id", "eos_id"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")
        if self.ffn not in T5_FFNS:
            raise ConfigError("ffn", f"must be one of {', '.join(T5_FFNS)}, got {self.ffn!r}")
        # The bidirectional encoder halves the buckets (one half per direction), and each half keeps
        # half of its buckets for exact distances: fewer than 4 leaves no room for the log-spaced ones.
        if self.rel_buckets < 4:
            raise ConfigError("rel_buckets", f"must be at least 4, got {self.rel_buckets}")
        if self.rel_max_distance <= self.rel_buckets // 2:
            raise ConfigError(
                "rel_max_distance",
                f"must exceed the exact-distance buckets (rel_buckets / 2 = {self.rel_buckets // 2}), "
                f"got {self.rel_max_distance}",
            )
        for key in ("norm_eps", "init_factor"):
            if not 0 < getattr(self, key) < math.inf:
                raise ConfigError(key, f"must be a positive finite number, got {getattr(self, key)}")
        if self.vocab_size:
            for key in ("pad_id", "eos_id"):
                if getattr(self, key) >= self.vocab_size:
                    raise ConfigError(key, f"{getattr(self, key)} is outside the vocabulary 0..{self.vocab_size - 1}")
