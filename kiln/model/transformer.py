"""The decoder-only Transformer: one readable file, no parallelism inside.

Layout (pre-norm, as in GPT-2/Llama):  x = x + attn(norm(x));  x = x + ffn(norm(x)).

Conventions chosen so that the weights map one-to-one onto Hugging Face Llama/Qwen2 checkpoints:
- RoPE uses the "rotate half" pairing (dimension i is rotated with i + head_dim/2), which is the layout
  HF Llama checkpoints are stored in. Exporting or importing q/k weights therefore needs no row
  permutation; only original Meta-format (interleaved-pair) weights would, and Kiln does not read those.
- q, k and v live in one fused projection `wqkv`: one wide matmul instead of three narrow ones saves
  kernel launches and re-reads of the input. Its rows are ordered so that any contiguous, evenly
  sized block of rows is self-contained (Megatron's layout): grouped by key/value head, each group
  holding its query heads, then its k head, then its v head. Tensor parallelism can then split it by
  plain row chunks and every rank gets whole heads, whatever its degree. `fuse_qkv`/`split_qkv`
  convert to and from the separate matrices that Hugging Face checkpoints store.
- The SwiGLU gate and up projections are two matrices, `w1` (gate) and `w3` (up), as in Llama and
  torchtitan. One fused matrix would need its gate and up rows interleaved for tensor parallelism's
  row chunks, and reading every other column of its output is what the elementwise SiLU-and-product
  kernel (and its backward) then spends its time on: 4x Hugging Face's separate-matrix kernel in a
  compiled bf16 step on an AMX CPU (docs/benchmarks.md, "SwiGLU layout").
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.model.config import ModelConfig
from kiln.model.memory import require_memory
from kiln.model.moe import MoEFeedForward
from kiln.model.norm import RMSNorm
from kiln.model.rope import rope_tables, rotation


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x[i], x[i + d/2]) pair of the last dimension by its position's angle."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated_half = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated_half * sin


def sinusoidal_table(dim: int, max_seq_len: int, device=None) -> torch.Tensor:
    """The fixed absolute position encoding of Vaswani et al. 2017: [max_seq_len, dim]."""
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float64), inv_freq)
    table = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)  # sin, cos interleaved
    return table[:, :dim].float()


def position_table_bytes(cfg: ModelConfig) -> int:
    """Bytes the position tables of `cfg` take while init_weights builds them: the float32 buffers
    (or learned embedding) and the float64 tables they are computed from."""
    if cfg.pos == "rope":
        return cfg.max_seq_len * cfg.head_dim * 2 * (4 + 8)  # cos and sin, float32 kept, float64 built
    if cfg.pos == "sinusoidal":
        return cfg.max_seq_len * cfg.dim * (4 + 2 * 8)  # float32 kept; sin and cos stacked in float64
    return cfg.max_seq_len * cfg.dim * 4  # the learned embedding


def require_position_memory(cfg: ModelConfig, device: torch.device) -> None:
    """ConfigError("max_seq_len") when the position tables alone cannot fit on `device`, before any
    allocation: a context of a billion tokens is a valid integer the allocator cannot serve."""
    require_memory(
        "max_seq_len", f"the position tables for max_seq_len={cfg.max_seq_len}", position_table_bytes(cfg), device
    )


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.dim, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """Separate q [H*hd, ...], k and v [KV*hd, ...] -> the grouped fused layout of `wqkv`."""
    groups = [t.unflatten(0, (n_kv_heads, -1)) for t in (q, k, v)]  # [KV, rows per group, ...]
    return torch.cat(groups, dim=1).flatten(0, 1)


def split_qkv(wqkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int):
    """Inverse of fuse_qkv: (q, k, v) with all query heads first, as Hugging Face stores them."""
    per_group = (n_heads // n_kv_heads) * head_dim
    grouped = wqkv.unflatten(0, (n_kv_heads, -1))
    q, k, v = grouped.split([per_group, head_dim, head_dim], dim=1)
    return q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """q [B, H, T, hd], k and v [B, KV, T, hd] -> [B, H, T, hd]. enable_gqa lets each group of query
    heads read its shared k/v head in place, instead of materialising repeated copies of k and v.
    mask [B, 1, T, T] (True = may attend) replaces the plain causal mask, e.g. for packed documents."""
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # A plain attribute so context parallelism can swap in an attention that sees the other ranks'
        # keys and values (kiln.parallel.context) without the model knowing about it.
        self.attention = causal_attention
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.use_rope = cfg.pos == "rope"
        qkv_out = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.wqkv = nn.Linear(cfg.dim, qkv_out, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)
        # QK-norm bounds the attention logits, whose growth destabilises training at high learning
        # rates (Dehghani et al. 2023); one weight of head_dim shared by all heads, as Qwen3 and OLMo2.
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        mask: torch.Tensor | None = None,
        *,
        kv_cache=None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 groups: under tensor parallelism this rank holds only some of the key/value groups.
        group = self.n_heads // self.n_kv_heads
        qkv = self.wqkv(x).view(batch, seq, -1, group + 2, self.head_dim)
        q, k, v = qkv.split([group, 1, 1], dim=3)
        # Each of q, k and v becomes its own [B, T, heads, head_dim] tensor before anything saves it
        # for backward, so no saved view keeps the whole fused qkv output (or a joint q|k RoPE output)
        # alive. Query head g*group + j reads kv head g, the order HF models use.
        q, k, v = q.flatten(2, 3), k.squeeze(3), v.squeeze(3).contiguous()
        if self.q_norm is not None:
            # The norms keep their inputs for backward: contiguous copies keep only q and k, where views
            # would keep the whole fused qkv output alive (for GQA q is already a copy: flatten copies).
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.use_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            k = k.contiguous()
        # [B, heads, T, head_dim] views of token-major tensors: SDPA then writes its output token-major
        # too, and the output projection reads it in place instead of from a copy.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv_cache is not None:
            # Inference (kiln.infer.kv_cache.KVCache): the new keys join the row's cached ones, and the
            # cache says how to mask queries that sit at an offset in their row (plain is_causal
            # would align them with the first cached key).
            k, v, masking = kv_cache.update(k, v)
            # A cache may keep keys in higher precision than the model (kiln.infer.static_decode keeps
            # them in float32 on the CPU, where one-query bf16 attention is several times slower).
            out = F.scaled_dot_product_attention(q.to(k.dtype), k, v, enable_gqa=group > 1, **masking).to(q.dtype)
            return self.wo(out.transpose(1, 2).flatten(2))
        # The mask is passed only when set, so swapped-in attentions need not know about it.
        out = self.attention(q, k, v, enable_gqa=group > 1, **({"mask": mask} if mask is not None else {}))
        return self.wo(out.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu = cfg.ffn == "swiglu"
        hidden = cfg.ffn_hidden_size
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)  # SwiGLU's gate, or GELU's up projection
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False) if self.swiglu else None  # SwiGLU's up
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.ffn_norm = make_norm(cfg)
        self.ffn = MoEFeedForward(cfg) if cfg.is_moe_layer(layer) else FeedForward(cfg)

    def forward(self, x, cos=None, sin=None, mask=None, *, kv_cache=None):
        extra = {"mask": mask} if mask is not None else {}
        if kv_cache is not None:
            extra["kv_cache"] = kv_cache
        x = x + self.attn(self.attn_norm(x), cos, sin, **extra)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        if cfg.vocab_size <= 0:
            raise ConfigError("vocab_size", f"must be set (> 0) before building a model, got {cfg.vocab_size}")
        require_position_memory(cfg, torch.get_default_device())  # the meta device has no limit
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        if cfg.pos == "learned":
            self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        # With tied embeddings the head reuses tok_embeddings.weight in forward rather than sharing
        # a Parameter object: a shared Parameter would be split in two by to_empty() on the meta path.
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Position tables are derived from the config, so they are not saved (persistent=False).
        if cfg.pos == "rope":
            self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        elif cfg.pos == "sinusoidal":
            self.register_buffer("pos_table", torch.empty(cfg.max_seq_len, cfg.dim), persistent=False)
        self.init_weights()

    def head_weight(self) -> torch.Tensor:
        """The output head's weight [vocab, dim]: the embedding's when they are tied."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer; deterministic under torch.manual_seed."""
        cfg = self.cfg
        device = self.tok_embeddings.weight.device
        if cfg.pos == "rope":
            # Dynamic scaling is the plain table up to its original context; rotation() rebuilds past it.
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device, cfg.rope_scaling)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
        elif cfg.pos == "sinusoidal":
            self.pos_table.copy_(sinusoidal_table(cfg.dim, cfg.max_seq_len, device=device))
        # Every block adds two residual branches (attention, FFN) to the stream; if each adds unit
        # variance the stream grows with depth. Scaling the std of the projections that write into the
        # stream by 1/sqrt(2 * n_layers) keeps its variance roughly depth-independent (GPT-2, sec. 2.3).
        residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=cfg.init_std)
        if cfg.pos == "learned":
            nn.init.normal_(self.pos_embeddings.weight, std=cfg.init_std)
        for block in self.layers:
            for norm in (block.attn_norm, block.ffn_norm):
                norm.reset_parameters()  # weight 1, bias 0: each block starts as identity-plus-branch
            if block.attn.q_norm is not None:
                block.attn.q_norm.reset_parameters()
                block.attn.k_norm.reset_parameters()
            nn.init.normal_(block.attn.wqkv.weight, std=cfg.init_std)
            if block.attn.wqkv.bias is not None:
                nn.init.zeros_(block.attn.wqkv.bias)
            nn.init.normal_(block.attn.wo.weight, std=residual_std)
            ffn = block.ffn
            if isinstance(ffn, MoEFeedForward):
                ffn.init_weights(cfg.init_std, residual_std)
                continue
            for up in (ffn.w1, ffn.w3) if ffn.swiglu else (ffn.w1,):
                nn.init.normal_(up.weight, std=cfg.init_std)
            nn.init.normal_(ffn.w2.weight, std=residual_std)
        self.norm.reset_parameters()
        if self.output is not None:
            nn.init.normal_(self.output.weight, std=cfg.init_std)

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache=None,
        hidden_only: bool = False,
    ) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab] (with hidden_only, the final-normed hidden states
        [B, T, dim] instead: a chunked loss head applies `head_weight()` itself).
        position_ids [B, T] (default 0..T-1 in every row) only set the positions used by RoPE or the absolute embeddings. Attention is causal over the
        whole row unless document_ids [B, T] are given: then a token attends only to earlier tokens of
        its own document, so several sequences packed in one row do not see each other.
        kv_cache (a kiln.infer.kv_cache.KVCache): tokens are appended after each row's cached tokens,
        attend to them, and are cached in turn; positions then default to each row's cache length
        onwards."""
        seq = tokens.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds model max_seq_len={self.cfg.max_seq_len}")
        if kv_cache is not None:
            if document_ids is not None:
                raise ValueError("document_ids cannot be combined with kv_cache (one sequence per cached row)")
            cache_positions = kv_cache.prepare(seq)
            position_ids = cache_positions if position_ids is None else position_ids
        if position_ids is None:
            positions = slice(0, seq)  # [T, ...] tables broadcast over the batch
            extent = seq
            head_axis = 1  # cos/sin [T, 1, head_dim] against q/k [B, T, heads, head_dim]
        else:
            if position_ids.shape != tokens.shape:
                raise ValueError(
                    f"position_ids shape {tuple(position_ids.shape)} != tokens shape {tuple(tokens.shape)}"
                )
            positions = position_ids
            dynamic = self.cfg.rope_scaling is not None and self.cfg.rope_scaling.type == "dynamic"
            extent = int(position_ids.max()) + 1 if dynamic else 0  # a device sync, so only when it is read
            head_axis = 2  # cos/sin [B, T, 1, head_dim]
        x = self.tok_embeddings(tokens)
        cos = sin = None
        if self.cfg.pos == "rope":
            cos, sin = rotation(self.cfg, self.rope_cos, self.rope_sin, positions, extent)
            cos, sin = cos.unsqueeze(head_axis), sin.unsqueeze(head_axis)
            if torch.is_autocast_enabled(x.device.type):
                # Under autocast the projections return low precision; rotating in that dtype (as HF
                # does) avoids upcasting q and k and keeps the logits comparable with transformers.
                dtype = torch.get_autocast_dtype(x.device.type)
                cos, sin = cos.to(dtype), sin.to(dtype)
        elif self.cfg.pos == "learned":
            x = x + self.pos_embeddings(
                position_ids if position_ids is not None else torch.arange(seq, device=x.device)
            )
        else:
            x = x + self.pos_table[positions]
        mask = None
        if document_ids is not None:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=tokens.device).tril()
            mask = (document_ids[:, :, None] == document_ids[:, None, :]) & causal
            mask = mask.unsqueeze(1)  # [B, 1, T, T], broadcast over heads
        if kv_cache is not None:
            for layer, block in enumerate(self.layers):
                x = block(x, cos, sin, kv_cache=kv_cache.layer(layer))
            kv_cache.advance(seq)
        else:
            for block in self.layers:
                x = block(x, cos, sin, mask) if mask is not None else block(x, cos, sin)
        x = self.norm(x)
        if hidden_only:
            return x
        if self.output is None:
            return F.linear(x, self.tok_embeddings.weight)
        return self.output(x)  # through the module, so a parallelised head's layouts apply


def build_model(cfg: ModelConfig, device="cpu") -> Transformer:
    """Create the module on the meta device (no memory, no wasted init), then allocate it on `device`
    and initialise there: the same path a sharded model takes, where parallelism wraps the meta model
    before any weight exists."""
    with torch.device("meta"):
        model = Transformer(cfg)
    require_position_memory(cfg, torch.device(device))
    model.to_empty(device=device)
    model.init_weights()
    return model


def count_params(model_or_cfg, non_embedding: bool = False, active: bool = False) -> int:
    """Number of parameters. non_embedding=True leaves out every vocabulary-sized matrix (token
    embeddings and the output head) and learned position embeddings (Kaplan et al. 2020), the
    quantity scaling laws are stated in. active=True counts, in MoE layers, only the moe_top_k
    experts a token runs through (plus router and shared expert): the parameters that cost FLOPs."""
    cfg = model_or_cfg.cfg if isinstance(model_or_cfg, nn.Module) else model_or_cfg
    n_moe = sum(cfg.is_moe_layer(layer) for layer in range(cfg.n_layers))
    idle_experts = n_moe * (cfg.n_experts - cfg.moe_top_k) * 3 * cfg.dim * cfg.moe_hidden_size if active else 0
    if isinstance(model_or_cfg, nn.Module):
        model = model_or_cfg
        total = sum(p.numel() for p in model.parameters()) - idle_experts
        if non_embedding:
            total -= model.tok_embeddings.weight.numel()
            if model.output is not None:
                total -= model.output.weight.numel()
            if hasattr(model, "pos_embeddings"):
                total -= model.pos_embeddings.weight.numel()
        return total
    dim, hidden, head_dim = cfg.dim, cfg.ffn_hidden_size, cfg.head_dim
    norm = dim if cfg.norm == "rmsnorm" else 2 * dim  # LayerNorm also has a bias
    qkv_out = (cfg.n_heads + 2 * cfg.kv_heads) * head_dim
    attn = dim * qkv_out + (qkv_out if cfg.qkv_bias else 0) + cfg.n_heads * head_dim * dim
    attn += 2 * head_dim if cfg.qk_norm else 0  # the q and k norm weights
    ffn = (3 if cfg.ffn == "swiglu" else 2) * dim * hidden
    # An MoE layer: router, n_experts SwiGLU experts, and the optional shared expert, instead of the FFN.
    moe = dim * cfg.n_experts + (cfg.n_experts + cfg.moe_shared_expert) * 3 * dim * cfg.moe_hidden_size
    total = cfg.n_layers * (attn + 2 * norm) + (cfg.n_layers - n_moe) * ffn + n_moe * moe + norm - idle_experts
    if non_embedding:
        return total
    total += cfg.vocab_size * dim * (1 if cfg.tie_embeddings else 2)
    if cfg.pos == "learned":
        total += cfg.max_seq_len * dim
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: forward + backward = 3x forward, 2 FLOPs per multiply-add.

    6 * N counts the weight matmuls, with N the non-embedding parameters plus the output head (the
    embedding lookup does no arithmetic, but the head is a dim x vocab matmul even when tied). In MoE
    layers N has only the active experts (count_params(active=True)); capacity drops are not
    subtracted, so with moe_capacity_factor > 0 this is an upper bound.
    The attention scores and the weighted sum of values add 2 * 2 * seq_len * dim per token per layer
    forward, i.e. 12 * n_layers * dim * seq_len for training (PaLM, appendix B). Causal masking could
    skip half of it; the convention (and MFU comparisons across codebases) counts all of it.
    """
    n = count_params(cfg, non_embedding=True, active=True) + cfg.vocab_size * cfg.dim
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
