"""Shape and options of the encoder-only BERT family (kiln/model/bert.py). Imports no torch.

A recipe selects it with `[model] arch = "bert"`; the other keys of that table are then this
dataclass's (kiln.model.config.model_config_class picks the class). The names follow the decoder's
ModelConfig where the meaning is the same (dim, n_layers, n_heads, ffn_hidden, max_seq_len, norm_eps,
init_std); what only BERT has keeps BERT's name (type_vocab_size, dropout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from kiln.errors import ConfigError


@dataclass
class BertConfig:
    arch: str = "bert"  # the key that selected this class; stored so a checkpoint knows its family
    vocab_size: int = 0  # 0: take the trained tokenizer's size
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    ffn_hidden: int = 0  # 0: 4 * dim, as in BERT
    max_seq_len: int = 256  # rows of the learned absolute position table
    type_vocab_size: int = 2  # segment (token type) embeddings: sentence A and B
    norm_eps: float = 1e-12  # BERT's LayerNorm epsilon
    dropout: float = 0.1  # hidden_dropout_prob: embeddings, each residual branch, the classifier input
    attn_dropout: float = 0.1  # attention_probs_dropout_prob: on the attention weights
    init_std: float = 0.02
    num_labels: int = 0  # 0: the masked-LM head; n > 0: sequence classification into n classes

    # Positions are a learned table, so a sequence may not be longer than it (kiln.recipe checks
    # train.seq_len against it as for the decoder's learned positions). Not a field: not a key.
    pos: ClassVar[str] = "learned"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_size(self) -> int:
        return self.ffn_hidden or 4 * self.dim

    def validate(self) -> None:
        if self.arch != "bert":
            raise ConfigError("arch", f"BertConfig is the 'bert' family, got {self.arch!r}")
        for key in ("dim", "n_layers", "n_heads", "max_seq_len", "type_vocab_size"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, f"must be positive, got {getattr(self, key)}")
        for key in ("vocab_size", "ffn_hidden", "num_labels"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")
        if self.dim % self.n_heads:
            raise ConfigError("n_heads", f"must divide dim={self.dim}, got {self.n_heads}")
        for key in ("norm_eps", "init_std"):
            if not 0 < getattr(self, key) < math.inf:
                raise ConfigError(key, f"must be a positive finite number, got {getattr(self, key)}")
        for key in ("dropout", "attn_dropout"):
            # 1 would zero every activation: nothing could train.
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(key, f"must be in [0, 1), got {getattr(self, key)}")
