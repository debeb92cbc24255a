import math

import pytest
import torch
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.model import ModelConfig, build_model, count_params, flops_per_token
from kiln.model.moe import MoEFeedForward, moe_aux_loss, moe_stats
from kiln.model.transformer import FeedForward


def moe_cfg(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=97,
        dim=32,
        n_layers=2,
        n_heads=4,
        max_seq_len=32,
        moe_every=1,
        n_experts=4,
        moe_top_k=2,
        moe_hidden=48,
    )
    return ModelConfig(**{**base, **overrides})


def random_moe(cfg: ModelConfig, router_std: float = 1.0) -> MoEFeedForward:
    """An MoE layer with O(1) weights, so routing is decisive and outputs are far from zero."""
    moe = MoEFeedForward(cfg)
    with torch.no_grad():
        moe.init_weights(0.2, 0.2)
        moe.router.weight.normal_(std=router_std)
    return moe


def naive_moe(moe: MoEFeedForward, x: torch.Tensor, capacity: int | None = None) -> tuple[torch.Tensor, int]:
    """Token by token: the chosen experts' SwiGLU outputs weighted by their gates; capacity handed out
    to all first choices in token order, then all second choices."""
    n_tokens, k = x.shape[0], moe.top_k
    probs = torch.softmax(x @ moe.router.weight.T, dim=-1)
    out = torch.zeros_like(x)
    load, dropped = [0] * moe.n_experts, 0
    for slot in range(k):
        for t in range(n_tokens):
            ranked = sorted(range(moe.n_experts), key=lambda e: -probs[t, e].item())[:k]
            expert = ranked[slot]
            gate = probs[t, expert]
            if moe.norm_topk:
                gate = gate / probs[t, ranked].sum()
            if capacity is not None and load[expert] >= capacity:
                dropped += 1
                continue
            load[expert] += 1
            w_gate, w_up = moe.experts.w1[expert], moe.experts.w3[expert]
            hidden = F.silu(w_gate @ x[t]) * (w_up @ x[t])
            out[t] += gate * (moe.experts.w2[expert] @ hidden)
    if moe.shared_expert is not None:
        w_gate, w_up = moe.shared_expert.w1.weight, moe.shared_expert.w3.weight
        out += (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ moe.shared_expert.w2.weight.T
    return out, dropped


@pytest.mark.parametrize("top_k,norm_topk", [(1, False), (2, True), (2, False), (3, True)])
def test_matches_hugging_face_qwen3_moe_block(top_k, norm_topk):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = moe_cfg(moe_top_k=top_k, moe_norm_topk=norm_topk)
    hf = Qwen3MoeSparseMoeBlock(
        Qwen3MoeConfig(
            hidden_size=cfg.dim,
            moe_intermediate_size=cfg.moe_hidden,
            num_experts=cfg.n_experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=norm_topk,
        )
    )
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(std=0.3)
    moe = MoEFeedForward(cfg)
    with torch.no_grad():
        moe.router.weight.copy_(hf.gate.weight)
        gate, up = hf.experts.gate_up_proj.chunk(2, dim=1)  # HF keeps gate rows, then up rows
        moe.experts.w1.copy_(gate)
        moe.experts.w3.copy_(up)
        moe.experts.w2.copy_(hf.experts.down_proj)
    x = torch.randn(3, 10, cfg.dim)
    torch.testing.assert_close(moe(x), hf(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5, 8.0])
@pytest.mark.parametrize("shared", [False, True])
def test_matches_naive_per_token_reference(capacity_factor, shared):
    cfg = moe_cfg(moe_capacity_factor=capacity_factor, moe_shared_expert=shared)
    moe = random_moe(cfg)
    x = torch.randn(2, 12, cfg.dim)
    n_tokens = 24
    capacity = math.ceil(capacity_factor * n_tokens * cfg.moe_top_k / cfg.n_experts) if capacity_factor else None
    expected, dropped = naive_moe(moe, x.view(n_tokens, cfg.dim), capacity)
    torch.testing.assert_close(moe(x), expected.view_as(x), rtol=1e-5, atol=1e-5)
    assert int(moe.dropped) == dropped
    assert int(moe.routed) == n_tokens * cfg.moe_top_k
    # 0.5 leaves room for half the assignments, so some must drop; 8x the fair share never drops.
    assert (dropped > 0) == (capacity_factor == 0.5)


def hand_example(top_k: int, capacity_factor: float = 0.0) -> tuple[MoEFeedForward, torch.Tensor]:
    """Four tokens, two experts, router logits (ln 4, 0) or (0, ln 4): probabilities 0.8 / 0.2."""
    cfg = ModelConfig(
        dim=4, n_heads=1, n_experts=2, moe_top_k=top_k, moe_hidden=8, moe_every=1, moe_capacity_factor=capacity_factor
    )
    moe = random_moe(cfg)
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(2, 4))
    x = torch.zeros(4, 4)
    x[[0, 1, 3], 0] = math.log(4)
    x[2, 1] = math.log(4)
    x[:, 2:] = torch.randn(4, 2)  # invisible to the router, but makes every expert output nonzero
    return moe, x


def test_aux_and_z_loss_equal_the_published_formulas_on_a_hand_computed_example():
    moe, x = hand_example(top_k=1)
    moe(x)
    # Top-1 picks expert 0 for tokens 0, 1, 3 and expert 1 for token 2: f = (3/4, 1/4).
    # Mean probabilities P = ((0.8*3 + 0.2)/4, (0.2*3 + 0.8)/4) = (0.65, 0.35).
    # Switch: aux = E * sum f_i P_i = 2 * (0.75*0.65 + 0.25*0.35) = 1.15.
    torch.testing.assert_close(moe.aux_loss, torch.tensor(1.15))
    # ST-MoE: every token's logsumexp is ln(4 + 1) = ln 5.
    torch.testing.assert_close(moe.z_loss, torch.tensor(math.log(5) ** 2))
    # With top-2 every token uses both experts: f = (1/2, 1/2), aux = 2 * 0.5 = 1, the minimum.
    moe2, _ = hand_example(top_k=2)
    moe2(x)
    torch.testing.assert_close(moe2.aux_loss, torch.tensor(1.0))


def test_aux_loss_matches_hugging_face_up_to_its_top_k_normalisation():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    cfg = moe_cfg(n_experts=6, moe_top_k=2)
    moe = random_moe(cfg)
    x = torch.randn(40, cfg.dim)
    moe(x)
    # HF's f_i counts assignments per token (they sum to k); ours is the fraction of assignments.
    hf = load_balancing_loss_func((x @ moe.router.weight.T,), cfg.n_experts, cfg.moe_top_k)
    torch.testing.assert_close(moe.aux_loss * cfg.moe_top_k, hf)


def test_capacity_drops_first_choices_before_second_choices():
    # Top-1, capacity ceil(1.0 * 4 * 1 / 2) = 2: expert 0 was chosen by tokens 0, 1, 3; token 3 drops.
    moe, x = hand_example(top_k=1, capacity_factor=1.0)
    out = moe(x)
    assert int(moe.dropped) == 1 and int(moe.routed) == 4
    assert out[3].abs().max() == 0 and (out[:3].abs().amax(dim=1) > 0).all()
    assert moe_stats(torch.nn.ModuleList([moe]))["dropped_frac"] == 0.25
    # Top-2, capacity ceil(0.5 * 4 * 2 / 2) = 2. Expert 0 serves first choices 0, 1 and drops first
    # choice 3 and second choice 2; expert 1 serves first choice 2 and second choice 0. Token 3 has
    # no expert left: its output is 0 and the block's residual carries it.
    moe, x = hand_example(top_k=2, capacity_factor=0.5)
    out = moe(x)
    assert int(moe.dropped) == 4
    assert out[3].abs().max() == 0 and (out[:3].abs().amax(dim=1) > 0).all()
    # A large factor drops nothing and equals the dropless layer.
    moe_free, _ = hand_example(top_k=2)
    moe_free.load_state_dict(moe.state_dict())
    moe.capacity_factor = 4.0
    torch.testing.assert_close(moe(x), moe_free(x))
    assert int(moe.dropped) == 0


def test_shared_expert_adds_a_dense_swiglu_for_every_token():
    cfg = moe_cfg(moe_shared_expert=True)
    with_shared = random_moe(cfg)
    routed_only = MoEFeedForward(moe_cfg())
    routed_only.load_state_dict({k: v for k, v in with_shared.state_dict().items() if "shared" not in k})
    dense = FeedForward(moe_cfg(ffn_hidden=cfg.moe_hidden))
    dense.load_state_dict(with_shared.shared_expert.state_dict())
    x = torch.randn(2, 5, cfg.dim)
    torch.testing.assert_close(with_shared(x), routed_only(x) + dense(x), rtol=1e-5, atol=1e-6)


def test_router_gets_gradients_from_the_output_and_from_the_aux_loss():
    moe = random_moe(moe_cfg())
    x = torch.randn(16, moe.router.weight.shape[1])
    moe(x).square().sum().backward()
    assert moe.router.weight.grad.abs().sum() > 0
    assert all(getattr(moe.experts, w).grad.abs().sum() > 0 for w in ("w1", "w3", "w2"))
    # Top-1 with renormalised gates: the gate is g / g = 1, so the output's gradient reaches the
    # router only as rounding noise and the aux and z losses are what train it.
    moe = random_moe(moe_cfg(moe_top_k=1, moe_norm_topk=True))
    moe(x).square().sum().backward()
    assert moe.router.weight.grad.abs().max() < 1e-5
    moe.zero_grad()
    wrapper = torch.nn.ModuleList([moe])
    moe(x)
    expected = 0.01 * moe.aux_loss + 0.001 * moe.z_loss
    torch.testing.assert_close(moe_aux_loss(wrapper), expected)
    moe_aux_loss(wrapper).backward()
    assert moe.router.weight.grad.abs().max() > 1e-3


def test_layer_selection_and_parameter_counts():
    every_other = moe_cfg(n_layers=4, moe_every=2)
    assert [every_other.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    listed = moe_cfg(n_layers=4, moe_every=1, moe_layers=[0, 2])
    assert [listed.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    model = build_model(every_other)
    kinds = [type(block.ffn).__name__ for block in model.layers]
    assert kinds == ["FeedForward", "MoEFeedForward", "FeedForward", "MoEFeedForward"]
    for cfg in (every_other, listed, moe_cfg(moe_shared_expert=True), moe_cfg(moe_hidden=0, tie_embeddings=True)):
        model = build_model(cfg)
        assert count_params(model) == count_params(cfg) == sum(p.numel() for p in model.parameters())
        n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
        idle = n_moe * (cfg.n_experts - cfg.moe_top_k) * 3 * cfg.dim * cfg.moe_hidden_size
        assert count_params(cfg, active=True) == count_params(model, active=True) == count_params(cfg) - idle
        n = count_params(cfg, non_embedding=True, active=True) + cfg.vocab_size * cfg.dim
        assert flops_per_token(cfg, 32) == 6 * n + 12 * cfg.n_layers * cfg.dim * 32
    # Derived expert width is the dense FFN's; top-k of E copies costs k dense FFNs of FLOPs.
    assert moe_cfg(moe_hidden=0).moe_hidden_size == moe_cfg(moe_every=0).ffn_hidden_size


@pytest.mark.parametrize(
    "overrides,key",
    [
        ({"moe_top_k": 5}, "moe_top_k"),
        ({"moe_top_k": 0}, "moe_top_k"),
        ({"n_experts": 0}, "n_experts"),
        ({"ffn": "gelu"}, "ffn"),
        ({"moe_layers": [2]}, "moe_layers"),
        ({"moe_layers": [1, 1]}, "moe_layers"),
        ({"moe_capacity_factor": -1.0}, "moe_capacity_factor"),
        ({"moe_every": -1}, "moe_every"),
        ({"moe_aux_loss_weight": -0.1}, "moe_aux_loss_weight"),
    ],
)
def test_bad_moe_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        moe_cfg(**overrides).validate()
    assert err.value.key == key
    # A dense model ignores the expert settings.
    moe_cfg(moe_every=0, moe_top_k=5).validate()


def test_meta_build_init_is_deterministic_and_experts_differ():
    cfg = moe_cfg(moe_shared_expert=True, n_layers=4, dim=64, moe_hidden=128)
    torch.manual_seed(3)
    a = build_model(cfg)
    torch.manual_seed(3)
    b = build_model(cfg)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert not pa.is_meta, name
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    experts = a.layers[0].ffn.experts
    assert not torch.equal(experts.w1[0], experts.w1[1]) and not torch.equal(experts.w1[0], experts.w3[0])
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    assert experts.w1.std().item() == pytest.approx(cfg.init_std, rel=0.05)
    assert experts.w3.std().item() == pytest.approx(cfg.init_std, rel=0.05)
    assert experts.w2.std().item() == pytest.approx(residual_std, rel=0.05)


def test_bf16_autocast_runs_router_in_fp32_and_stays_close():
    model = build_model(moe_cfg(moe_shared_expert=True))
    tokens = torch.randint(0, 97, (2, 16))
    reference = model(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    torch.testing.assert_close(logits.float(), reference, rtol=0.05, atol=0.05)
    assert model.layers[0].ffn.aux_loss.dtype == torch.float32


def test_tiny_moe_model_trains_with_the_aux_loss():
    cfg = moe_cfg(moe_capacity_factor=1.25, moe_shared_expert=True)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, cfg.vocab_size, (4, 17))
    losses = []
    for _ in range(20):
        logits = model(tokens[:, :-1])
        lm = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        (lm + moe_aux_loss(model)).backward()
        opt.step()
        opt.zero_grad()
        losses.append(lm.item())
    assert losses[-1] < 0.7 * losses[0], losses
    stats = moe_stats(model)
    assert set(stats) == {"dropped_frac", "load_max", "load_cv", "aux_loss", "z_loss"}
    assert 0 <= stats["dropped_frac"] < 1 and 1 <= stats["load_max"] <= cfg.n_experts


@pytest.mark.slow
def test_torch_compile_matches_eager():
    cfg = moe_cfg(moe_capacity_factor=1.0, moe_shared_expert=True)
    model = build_model(cfg)
    tokens = torch.randint(0, 97, (2, 16))

    def loss_fn(m, t):
        logits = m(t[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), t[:, 1:].flatten()) + moe_aux_loss(m)

    eager = loss_fn(model, tokens)
    eager.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(loss_fn)(model, tokens)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    # The statistics recorded inside the compiled forward are readable afterwards.
    assert moe_stats(model)["dropped_frac"] > 0


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_the_same_routing(mode):
    from kiln.parallel.parallelize import apply_activation_checkpointing

    cfg = moe_cfg(moe_capacity_factor=1.0, moe_shared_expert=True)
    plain = build_model(cfg)
    checkpointed = build_model(cfg)
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed, mode)
    tokens = torch.randint(0, 97, (2, 17))
    for model in (plain, checkpointed):
        logits = model(tokens[:, :-1])
        (F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + moe_aux_loss(model)).backward()
    grads = dict(plain.named_parameters())
    for name, p in checkpointed.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
