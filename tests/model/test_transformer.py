import math

import pytest
import torch
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.model import ModelConfig, Transformer, build_model, count_params, flops_per_token
from kiln.model.transformer import apply_rope, fuse_qkv, rope_tables, split_qkv


def tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, max_seq_len=32)
    return ModelConfig(**{**base, **overrides})


def test_logits_shape_and_dtype():
    model = build_model(tiny())
    logits = model(torch.randint(0, 97, (3, 20)))
    assert logits.shape == (3, 20, 97)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"n_kv_heads": 2},
        {"n_kv_heads": 1},
        {"pos": "learned"},
        {"pos": "sinusoidal"},
        {"norm": "layernorm"},
        {"ffn": "gelu"},
        {"tie_embeddings": True},
        {"qkv_bias": True},
    ],
)
def test_each_option_runs_is_causal_and_trains(overrides):
    model = build_model(tiny(**overrides))
    tokens = torch.randint(0, 97, (2, 16))
    logits = model(tokens)
    # Changing a future token must not change any earlier position's logits.
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 97
    logits_changed = model(changed)
    torch.testing.assert_close(logits[:, :10], logits_changed[:, :10], rtol=0, atol=0)
    assert not torch.allclose(logits[:, 10:], logits_changed[:, 10:])
    # Every parameter receives a gradient (nothing is disconnected).
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_count_params_matches_module_for_every_option():
    for overrides in [
        {},
        {"n_kv_heads": 1, "qkv_bias": True},
        {"pos": "learned", "norm": "layernorm"},
        {"ffn": "gelu", "tie_embeddings": True},
    ]:
        cfg = tiny(**overrides)
        model = build_model(cfg)
        assert count_params(model) == count_params(cfg) == sum(p.numel() for p in model.parameters())
        assert count_params(model, non_embedding=True) == count_params(cfg, non_embedding=True)
    cfg = tiny()
    heads = cfg.vocab_size * cfg.dim * 2  # embedding + untied head
    assert count_params(cfg) - count_params(cfg, non_embedding=True) == heads


def test_flops_per_token_formula():
    cfg = tiny()
    n = count_params(cfg, non_embedding=True) + cfg.vocab_size * cfg.dim
    assert flops_per_token(cfg, 32) == 6 * n + 12 * cfg.n_layers * cfg.dim * 32
    assert flops_per_token(cfg, 64) > flops_per_token(cfg, 32)


def test_meta_build_materialises_and_init_is_deterministic():
    cfg = tiny(n_kv_heads=2)
    torch.manual_seed(1)
    a = build_model(cfg)
    torch.manual_seed(1)
    b = build_model(cfg)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert not pa.is_meta, name
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    # Buffers (RoPE tables) are recomputed after to_empty, not left as garbage.
    cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    torch.testing.assert_close(a.rope_cos, cos)
    torch.testing.assert_close(a.rope_sin, sin)
    # init_weights alone reproduces the same weights on an already-built model.
    torch.manual_seed(1)
    c = Transformer(cfg)
    torch.manual_seed(1)
    c.init_weights()
    for pa, pc in zip(a.parameters(), c.parameters()):
        torch.testing.assert_close(pa, pc, rtol=0, atol=0)


def test_init_scales_residual_projections():
    cfg = tiny(n_layers=8, dim=128, init_std=0.02)
    model = build_model(cfg)
    expected = 0.02 / math.sqrt(2 * cfg.n_layers)
    wo = torch.cat([b.attn.wo.weight.flatten() for b in model.layers])
    assert abs(wo.std().item() - expected) < 0.1 * expected
    assert abs(model.layers[0].attn.wqkv.weight.std().item() - 0.02) < 0.002


def reference_attention_model(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """The same network written out naively: per-head loops, explicit mask, rotation by complex numbers."""
    cfg = model.cfg
    hd, h, kvh = cfg.head_dim, cfg.n_heads, cfg.kv_heads
    seq = tokens.shape[1]
    x = model.tok_embeddings.weight[tokens]
    angles = torch.outer(
        torch.arange(seq, dtype=torch.float64), cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    )
    rotation = torch.polar(torch.ones_like(angles), angles)

    def rope(t):  # rotate-half layout: pair (i, i + hd/2) is the complex number t_i + j t_{i+hd/2}
        z = torch.complex(t[..., : hd // 2].double(), t[..., hd // 2 :].double()) * rotation
        return torch.cat([z.real, z.imag], dim=-1).float()

    def rms(t, w):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * w

    mask = torch.full((seq, seq), float("-inf")).triu(1)
    for block in model.layers:
        a = rms(x, block.attn_norm.weight)
        q_w, k_w, v_w = split_qkv(block.attn.wqkv.weight, h, kvh, hd)
        q = (a @ q_w.T).view(*a.shape[:2], h, hd)
        k = (a @ k_w.T).view(*a.shape[:2], kvh, hd)
        v = (a @ v_w.T).view(*a.shape[:2], kvh, hd)
        heads = []
        for i in range(h):
            j = i // (h // kvh)  # query head i reads kv head j
            scores = rope(q[:, :, i]) @ rope(k[:, :, j]).transpose(1, 2) / math.sqrt(hd) + mask
            heads.append(scores.softmax(-1) @ v[:, :, j])
        x = x + torch.cat(heads, dim=-1) @ block.attn.wo.weight.T
        f = rms(x, block.ffn_norm.weight)
        gate_w, up_w = block.ffn.w1.weight, block.ffn.w3.weight
        gate, up = f @ gate_w.T, f @ up_w.T
        x = x + (gate * torch.sigmoid(gate) * up) @ block.ffn.w2.weight.T
    return rms(x, model.norm.weight) @ model.output.weight.T


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_matches_naive_reference_for_mha_gqa_mqa(kv_heads):
    model = build_model(tiny(n_kv_heads=kv_heads))
    tokens = torch.randint(0, 97, (2, 24))
    torch.testing.assert_close(model(tokens), reference_attention_model(model, tokens), rtol=1e-4, atol=1e-4)


def test_gqa_with_all_heads_equals_plain_mha():
    mha = build_model(tiny(n_kv_heads=0))
    gqa = build_model(tiny(n_kv_heads=4))
    gqa.load_state_dict(mha.state_dict())
    tokens = torch.randint(0, 97, (2, 16))
    torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=0, atol=0)


def test_rope_matches_complex_multiplication():
    head_dim, seq = 16, 12
    cos, sin = rope_tables(head_dim, seq, theta=500.0)
    x = torch.randn(seq, head_dim)
    got = apply_rope(x, cos, sin)
    freqs = 500.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * freqs
    z = torch.complex(x[:, : head_dim // 2].double(), x[:, head_dim // 2 :].double()) * torch.exp(1j * angles)
    expected = torch.cat([z.real, z.imag], dim=-1).float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # A rotation preserves norms, and relative position is all that matters for q.k.
    torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1))


@pytest.mark.parametrize("pos", ["rope", "learned", "sinusoidal"])
def test_position_ids_set_positions(pos):
    model = build_model(tiny(pos=pos))
    tokens = torch.randint(0, 97, (2, 16))
    default = torch.arange(16).expand(2, 16)
    torch.testing.assert_close(model(tokens, default), model(tokens), rtol=0, atol=0)
    # Shifting every position by 5 moves absolute encodings but not relative ones.
    shifted = model(tokens, default + 5)
    if pos == "rope":  # RoPE only sees relative positions: a constant shift changes nothing
        torch.testing.assert_close(shifted, model(tokens), rtol=1e-4, atol=1e-4)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="vocab_size"):
        Transformer(tiny(vocab_size=0))
    with pytest.raises(ConfigError, match="n_kv_heads"):
        Transformer(tiny(n_kv_heads=3))
    model = build_model(tiny())
    with pytest.raises(ValueError, match="max_seq_len=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids shape"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.arange(3)[None])


def test_tiny_model_overfits_one_batch():
    cfg = tiny(vocab_size=50, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
    model = build_model(cfg)
    tokens = torch.randint(0, 50, (4, 33))
    x, y = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05, loss.item()


def test_bf16_autocast_close_to_fp32():
    model = build_model(tiny(n_kv_heads=2))
    tokens = torch.randint(0, 97, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(tokens)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), model(tokens), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("heads,kv_heads,chunks", [(4, 2, 2), (8, 2, 2), (4, 4, 4), (6, 3, 3)])
def test_fused_qkv_layout_splits_into_self_contained_row_chunks(heads, kv_heads, chunks):
    # Tensor parallelism cuts wqkv into equal row blocks; each block must hold whole key/value
    # groups (their query heads, k and v).
    hd, dim = 4, 8
    q = torch.randn(heads * hd, dim)
    k, v = torch.randn(kv_heads * hd, dim), torch.randn(kv_heads * hd, dim)
    fused = fuse_qkv(q, k, v, kv_heads)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, heads, kv_heads, hd), (q, k, v)))
    for i, block in enumerate(fused.chunk(chunks)):
        local = kv_heads // chunks
        qi, ki, vi = split_qkv(block, heads // chunks, local, hd)
        assert torch.equal(qi, q.chunk(chunks)[i]) and torch.equal(ki, k.chunk(chunks)[i])
        assert torch.equal(vi, v.chunk(chunks)[i])


def test_document_ids_keep_packed_sequences_apart():
    # Two sequences packed in one row with restarting positions give exactly the logits each
    # gives alone: no attention crosses the document boundary.
    model = build_model(tiny())
    a, b = torch.randint(0, 97, (1, 10)), torch.randint(0, 97, (1, 6))
    packed = torch.cat([a, b], dim=1)
    positions = torch.cat([torch.arange(10), torch.arange(6)]).unsqueeze(0)
    docs = torch.cat([torch.zeros(10), torch.ones(6)]).long().unsqueeze(0)
    out = model(packed, position_ids=positions, document_ids=docs)
    torch.testing.assert_close(out[:, :10], model(a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:, 10:], model(b), rtol=1e-5, atol=1e-5)
    # Without document_ids the second sequence would attend to the first.
    assert not torch.allclose(model(packed, position_ids=positions)[:, 10:], model(b), atol=1e-3)
