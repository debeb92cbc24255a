"""The static-shape compiled decode step (Engine(compile_decode=True)): the same tokens as the eager
engine, one graph for every step of a request, and refusals for models it cannot serve.

The fast tests trace with dynamo's "eager" backend (the graph is captured, shapes are guarded and
recompiles are counted exactly as with inductor, but nothing is code-generated); one slow test runs
inductor itself."""

import copy
import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from kiln.errors import ConfigError
from kiln.infer import quant
from kiln.infer.engine import Engine
from kiln.infer.quant import prepack_model
from kiln.infer.static_decode import CompiledDecoder, cache_length
from kiln.model import ModelConfig, build_model
from kiln.model.config import RopeScaling

# Different lengths, so rows sit at different cache lengths and finish at different steps.
PROMPTS = [[5, 17, 42], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9], [33, 2, 250, 7, 7]]

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(**overrides):
    torch.manual_seed(0)
    base = dict(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=40, init_std=0.2)
    return build_model(ModelConfig(**{**base, **overrides})).eval()


def compiled_engine(model, backend="eager") -> Engine:
    torch._dynamo.reset()
    counters.clear()
    engine = Engine(model)
    engine.decoder = CompiledDecoder(model, backend=backend)
    return engine


def graphs_and_recompiles() -> tuple[int, int]:
    return counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())


def assert_same(eager, static):
    for a, b in zip(eager, static):
        assert b.ids == a.ids
        assert b.finish_reason == a.finish_reason
        torch.testing.assert_close(b.logprobs, a.logprobs, rtol=0, atol=1e-4)


def assert_same_bf16(reference, static):
    """The same tokens, log-probabilities within bf16's rounding (inductor folds the frozen weights
    into its kernels in another order)."""
    for a, b in zip(reference, static):
        assert b.ids == a.ids
        torch.testing.assert_close(b.logprobs, a.logprobs, rtol=0.02, atol=0.02)


def test_cache_length_buckets():
    assert [cache_length(n, 4096) for n in (1, 64, 65, 159, 1000)] == [64, 64, 128, 256, 1024]
    assert cache_length(100, 96) == 96  # never past the model's context


@pytest.mark.parametrize("model_overrides", [{}, {"n_kv_heads": 1, "qkv_bias": True, "pos": "learned"}])
def test_greedy_equals_eager_and_one_graph_serves_every_step(model_overrides):
    model = tiny_model(**model_overrides)
    # 34 new tokens pass max_seq_len=40 for the 9-token prompt, so that row stops at the limit while
    # the others go on; stop tokens 66 and 234 end some rows early. Both leave finished rows in the batch.
    kwargs = dict(max_new_tokens=34, temperature=0, stop_token_ids=[66, 234])
    eager = Engine(model).generate(PROMPTS, **kwargs)
    assert len({len(c.ids) for c in eager}) > 1  # the rows did finish at different steps
    engine = compiled_engine(model)
    assert_same(eager, engine.generate(PROMPTS, **kwargs))
    assert graphs_and_recompiles() == (1, 0)
    # A second request of the same batch size and cache bucket reuses the graph.
    assert_same(Engine(model).generate(PROMPTS[::-1], **kwargs), engine.generate(PROMPTS[::-1], **kwargs))
    assert graphs_and_recompiles() == (1, 0)


def test_sampling_equals_eager_under_a_seed():
    model = tiny_model()
    kwargs = dict(max_new_tokens=20, temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.2, seed=3)
    eager = Engine(model).generate(PROMPTS, **kwargs)
    assert_same(eager, compiled_engine(model).generate(PROMPTS, **kwargs))


def test_stream_equals_generate():
    model = tiny_model()
    engine = compiled_engine(model)
    streamed = [t.id for t in engine.stream(PROMPTS[1], 12, temperature=0)]
    assert streamed == Engine(model).generate([PROMPTS[1]], 12, temperature=0)[0].ids


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"rope_scaling": RopeScaling("dynamic", 2.0, 20)}, "dynamic RoPE"),
        ({"n_experts": 2, "moe_top_k": 1, "moe_every": 1}, "MoE"),
    ],
)
def test_refuses_models_without_static_shapes(overrides, words):
    model = tiny_model()
    model.cfg = dataclasses.replace(model.cfg, **overrides)  # only the config is read
    with pytest.raises(ConfigError, match=words) as err:
        Engine(model, compile_decode=True)
    assert err.value.key == "compile_decode"


def test_refuses_encoder_decoder():
    model = tiny_model()
    model.encoder_decoder = True
    with pytest.raises(ConfigError, match="decoder-only") as err:
        Engine(model, compile_decode=True)
    assert err.value.key == "compile_decode"


@pytest.mark.slow
def test_inductor_greedy_equals_eager():
    """inductor with freezing (prepacked weights), fp32: ~10-20 s of compile on a shared 2-core machine."""
    model = tiny_model()
    kwargs = dict(max_new_tokens=34, temperature=0, stop_token_ids=[66, 234])
    engine = Engine(model, compile_decode=True)
    torch._dynamo.reset()
    counters.clear()
    assert_same(Engine(model).generate(PROMPTS, **kwargs), engine.generate(PROMPTS, **kwargs))
    assert graphs_and_recompiles() == (1, 0)


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 kernels on this CPU (AVX2 only)"
)
def test_prepacked_bf16_weights_compile_and_give_the_unpacked_tokens():
    """PackedLinear's opaque oneDNN weight reaches the graph (as a constant: the step of a prepacked
    model is traced under freezing); prepacking is bit-identical to F.linear, so the tokens are those
    of the plain bf16 model."""
    model = tiny_model().to(torch.bfloat16)
    kwargs = dict(max_new_tokens=20, temperature=0)
    plain = compiled_engine(model).generate(PROMPTS, **kwargs)
    packed = prepack_model(copy.deepcopy(model))
    assert_same(plain, compiled_engine(packed).generate(PROMPTS, **kwargs))
    assert graphs_and_recompiles() == (1, 0)


def test_prepacked_fp32_weights_compile_and_give_the_eager_tokens():
    """fp32 packed weights reach the graph as bf16 ones do, at a step of four streams and of one, with
    the tokens of eager decode on the same packed model."""
    packed = prepack_model(copy.deepcopy(tiny_model()))
    kwargs = dict(max_new_tokens=20, temperature=0)
    assert_same(Engine(packed).generate(PROMPTS, **kwargs), compiled_engine(packed).generate(PROMPTS, **kwargs))
    assert graphs_and_recompiles() == (1, 0)
    one = PROMPTS[1:2]
    assert_same(Engine(packed).generate(one, **kwargs), compiled_engine(packed).generate(one, **kwargs))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_calls_prepacked_weights_without_python(dtype, monkeypatch):
    """A prepacked model is traced under freezing: the packed weights become graph constants and
    inductor calls oneDNN itself, so no step calls back into PackedLinear (the custom op would, once
    per layer and step), and the tokens do not change."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bf16 kernels on this CPU (AVX2 only)")
    packed = prepack_model(tiny_model().to(dtype))
    kwargs = dict(max_new_tokens=20, temperature=0)
    torch._dynamo.reset()
    unfrozen = Engine(packed, compile_decode=True)
    unfrozen.decoder._freezing = None  # every packed linear through the custom op
    # fp32: eager decode's tokens; bf16: the compiled step keeps its cache and attention in fp32,
    # so the reference is the same step traced without freezing.
    reference = (Engine(packed) if dtype == torch.float32 else unfrozen).generate(PROMPTS, **kwargs)
    compiled = Engine(packed, compile_decode=True)
    check = assert_same if dtype == torch.float32 else assert_same_bf16
    check(reference, compiled.generate(PROMPTS, **kwargs))  # the first call traces and compiles
    looked_up = []  # what kiln::packed_linear's Python kernel reads its layer from, at every call
    layers = quant._PACKED_LAYERS
    monkeypatch.setattr(quant, "_PACKED_LAYERS", _Recording(layers, looked_up))
    check(reference, compiled.generate(PROMPTS, **kwargs))
    assert looked_up == []


class _Recording:
    def __init__(self, layers, keys: list):
        self.layers, self.keys = layers, keys

    def __getitem__(self, key):
        self.keys.append(key)
        return self.layers[key]
