"""The encoder-only BERT family (Devlin et al. 2019): one readable file, no parallelism inside.

Layout (post-norm, as in BERT and the original Transformer):
    x = attn_norm(x + dropout(attn(x)));  x = ffn_norm(x + dropout(ffn(x)))
Embeddings are token + learned absolute position + token type (segment), then LayerNorm and dropout.
Attention is bidirectional: a token sees every token of its row except padding, which
`attention_mask` [B, T] (1 = token, 0 = padding) hides as keys. The FFN is dense -> GELU (the exact
erf form BERT uses) -> dense, with biases everywhere.

The head is chosen by cfg.num_labels:
- 0, masked LM (as transformers' BertForMaskedLM): dense -> GELU -> LayerNorm, then the token
  embedding matrix, tied, plus a bias per vocabulary entry: logits [B, T, vocab].
- n > 0, sequence classification (as BertForSequenceClassification): the pooler (dense -> tanh on
  the first token's state), dropout, a linear classifier: logits [B, n].

Names follow kiln.model.transformer where the part is the same (tok_embeddings, pos_embeddings,
layers.i.attn / attn_norm / ffn / ffn_norm, the head under `output`), so the guard's gradient groups
and activation checkpointing (which wraps model.layers) apply unchanged. q, k and v share one
projection `wqkv` whose rows are all of q, then k, then v (no tensor parallelism splits it);
kiln/hf_bert.py maps the names to and from transformers'.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.model.bert_config import BertConfig


def padding_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """[B, T] with 1 for tokens and 0 for padding -> bool [B, 1, 1, T] (True = may be attended to),
    broadcast over heads and queries; None attends everywhere."""
    if attention_mask is None:
        return None
    return (attention_mask != 0)[:, None, None, :]


class SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.n_heads, self.head_dim, self.attn_dropout = cfg.n_heads, cfg.head_dim, cfg.attn_dropout
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.wqkv(x).view(batch, seq, 3, self.n_heads, self.head_dim).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, head_dim]
        dropout = self.attn_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        return self.wo(out.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden_size)
        self.w2 = nn.Linear(cfg.ffn_hidden_size, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.attn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.ffn = FeedForward(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # Post-norm: the residual sum is normalised, so the stream itself never grows with depth.
        x = self.attn_norm(x + self.drop(self.attn(x, mask)))
        return self.ffn_norm(x + self.drop(self.ffn(x)))


class MaskedLMHead(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.dim, cfg.dim)
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, x: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        # The decoder reuses tok_embeddings.weight in forward rather than sharing a Parameter, as the
        # decoder's tied head does: a shared Parameter would be split in two by to_empty().
        return F.linear(self.norm(F.gelu(self.dense(x))), embedding, self.bias)


class ClassifierHead(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.pooler = nn.Linear(cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.classifier = nn.Linear(cfg.dim, cfg.num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The first token's state stands for the sequence (BERT's [CLS]; Kiln's rows start with
        # <|endoftext|>, see kiln.data.mlm.classification_rows).
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return self.classifier(self.drop(pooled))


class Bert(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        cfg.validate()
        if cfg.vocab_size <= 0:
            raise ConfigError("vocab_size", f"must be set (> 0) before building a model, got {cfg.vocab_size}")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.dim)
        self.embed_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.output = ClassifierHead(cfg) if cfg.num_labels else MaskedLMHead(cfg)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """BERT's initialisation (as transformers applies it): every matrix and embedding from
        N(0, init_std), every bias 0, every LayerNorm weight 1 and bias 0. Deterministic under
        torch.manual_seed."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=self.cfg.init_std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        if isinstance(self.output, MaskedLMHead):
            nn.init.zeros_(self.output.bias)

    def encode(
        self,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [B, T] -> the last layer's hidden states [B, T, dim]. token_type_ids [B, T]
        default to 0 (one segment)."""
        seq = tokens.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds model max_seq_len={self.cfg.max_seq_len}")
        if attention_mask is not None and attention_mask.shape != tokens.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != tokens shape {tuple(tokens.shape)}"
            )
        x = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(seq, device=tokens.device))
        if token_type_ids is None:
            x = x + self.type_embeddings.weight[0]
        else:
            x = x + self.type_embeddings(token_type_ids)
        x = self.drop(self.embed_norm(x))
        mask = padding_mask(attention_mask)
        for block in self.layers:
            x = block(x, mask)
        return x

    def forward(
        self,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits: [B, T, vocab] from the masked-LM head, or [B, num_labels] from the classifier."""
        x = self.encode(tokens, attention_mask, token_type_ids)
        if isinstance(self.output, MaskedLMHead):
            return self.output(x, self.tok_embeddings.weight)
        return self.output(x)


HEAD_PREFIX = "output."


def load_encoder(model: Bert, state: dict[str, torch.Tensor], where) -> None:
    """Load every weight but the head's (a masked-LM checkpoint into a classifier, to fine-tune):
    the new head keeps its fresh initialisation. Refuses a state missing encoder weights or of
    another shape, naming the first."""
    encoder = {k: v for k, v in state.items() if not k.startswith(HEAD_PREFIX)}
    own = {k for k in model.state_dict() if not k.startswith(HEAD_PREFIX)}
    missing, unexpected = sorted(own - set(encoder)), sorted(set(encoder) - own)
    if missing or unexpected:
        raise ConfigError(
            "init_from",
            f"{where}: not a BERT encoder of this shape "
            + (f"(missing {missing[0]})" if missing else f"(unexpected {unexpected[0]})"),
        )
    try:
        model.load_state_dict(encoder, strict=False)
    except RuntimeError as err:
        raise ConfigError("init_from", f"{where}: weights do not fit ({str(err).strip().splitlines()[-1]})") from None


def count_params(model_or_cfg, non_embedding: bool = False, active: bool = False) -> int:
    """Parameters. non_embedding=True leaves out the token, position and type embeddings (the
    tied masked-LM decoder has no matrix of its own). Every parameter is active (no experts), so
    `active` changes nothing; it is accepted so callers treat every family alike."""
    cfg = model_or_cfg.cfg if isinstance(model_or_cfg, nn.Module) else model_or_cfg
    dim, hidden = cfg.dim, cfg.ffn_hidden_size
    norm = 2 * dim
    block = (3 * dim * dim + 3 * dim) + (dim * dim + dim) + (2 * dim * hidden + hidden + dim) + 2 * norm
    if cfg.num_labels:
        head = dim * dim + dim + dim * cfg.num_labels + cfg.num_labels
    else:
        head = dim * dim + dim + norm + cfg.vocab_size
    total = cfg.n_layers * block + norm + head
    if not non_embedding:
        total += (cfg.vocab_size + cfg.max_seq_len + cfg.type_vocab_size) * dim
    return total


def flops_per_token(cfg: BertConfig, seq_len: int) -> float:
    """Training FLOPs per token, counted as for the decoder (kiln.model.transformer.flops_per_token):
    6 per weight of the matmuls (the masked-LM head's tied dim x vocab matrix included, computed at
    every position) plus 12 * n_layers * dim * seq_len for the attention scores and the weighted sum."""
    n = count_params(cfg, non_embedding=True) + (0 if cfg.num_labels else cfg.vocab_size * cfg.dim)
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.dim * seq_len
