"""model.qk_norm: an RMSNorm over each head's q and k before RoPE (Qwen3, OLMo2)."""

import pytest
import torch

from kiln.errors import ConfigError
from kiln.model import ModelConfig, build_model
from kiln.model.transformer import count_params
from kiln.parallel.config import ParallelConfig
from kiln.parallel.dims import ParallelDims
from kiln.parallel.hardware import ClusterConfig
from kiln.parallel.plan import Layout, Workload, layout_problems, total_params


def config(**overrides) -> ModelConfig:
    return ModelConfig(
        **{**dict(vocab_size=53, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16), **overrides}
    )


TOKENS = torch.randint(0, 53, (2, 16), generator=torch.Generator().manual_seed(0))


def test_logits_do_not_depend_on_the_scale_of_the_q_and_k_projections():
    # With q and k normalised per head, scaling their rows of wqkv changes nothing; without, it does.
    for qk_norm in (True, False):
        torch.manual_seed(0)
        model = build_model(config(qk_norm=qk_norm)).eval()
        with torch.no_grad():
            before = model(TOKENS)
            for block in model.layers:
                # wqkv rows are grouped per kv head as [q of the group | k | v]; scale all but v.
                w = block.attn.wqkv.weight.view(model.cfg.kv_heads, -1, model.cfg.dim)
                w[:, : -model.cfg.head_dim] *= 7.0
            after = model(TOKENS)
        assert torch.allclose(before, after, atol=1e-4) == qk_norm


def test_norm_weights_are_per_head_dim_and_get_gradients():
    model = build_model(config(qk_norm=True))
    model(TOKENS).sum().backward()
    for block in model.layers:
        for norm in (block.attn.q_norm, block.attn.k_norm):
            assert norm.weight.shape == (model.cfg.head_dim,)
            assert norm.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("n_kv_heads", [0, 2, 1])
def test_parameter_counts_include_the_norms(n_kv_heads):
    cfg = config(qk_norm=True, n_kv_heads=n_kv_heads)
    plain = config(n_kv_heads=n_kv_heads)
    assert count_params(build_model(cfg)) == count_params(cfg) == total_params(cfg)
    assert count_params(cfg) - count_params(plain) == cfg.n_layers * 2 * cfg.head_dim


def test_qk_norm_needs_rmsnorm():
    with pytest.raises(ConfigError, match="qk_norm"):
        config(qk_norm=True, norm="layernorm").validate()


def test_tensor_parallelism_refuses_qk_norm_by_key():
    dims = ParallelDims.from_config(ParallelConfig(tp=2), world_size=2)
    dims.check_model(config(qk_norm=False))
    with pytest.raises(ConfigError, match="qk_norm"):
        dims.check_model(config(qk_norm=True))
    # The planner does not rank what the trainer refuses.
    cluster, work = ClusterConfig(gpus_per_node=2), Workload(32, 64)
    assert not any("qk_norm" in p for p in layout_problems(config(qk_norm=False), Layout(tp=2), cluster, work))
    assert any("qk_norm" in p for p in layout_problems(config(qk_norm=True), Layout(tp=2), cluster, work))
