import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from kiln_testing.reference_generate import reference_generate

from kiln.errors import ConfigError
from kiln.infer.engine import Engine
from kiln.infer.quant import (
    Int4Linear,
    Int8Linear,
    PackedLinear,
    int4_layout_is_native,
    model_bytes,
    pack_int4,
    prepack_model,
    quantize_model,
    quantized_bits_per_param,
    unpack_int4,
)
from kiln.model import ModelConfig, build_model
from kiln.peft.nf4 import NF4Linear


def _torchao_primitives():
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # CPU-only: skip the CUDA kernels
    return pytest.importorskip("torchao.quantization.quant_primitives")


def linear(n_out, n_in, bias=False, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        layer.weight[3, :] = 0.0  # an all-zero row
        layer.weight[5, :32] = 0.7  # a constant group
        if bias:
            layer.bias.normal_()
    return layer.to(dtype)


def small_model(**overrides):
    torch.manual_seed(0)
    base = dict(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=48, init_std=0.1)
    return build_model(ModelConfig(**{**base, **overrides})).eval()


def test_int8_matches_torchao_bit_for_bit():
    """Codes and scales equal torchao's symmetric per-row int8 (what Int8WeightOnlyConfig builds on)."""
    qp = _torchao_primitives()
    w = linear(96, 128).weight.detach()
    scale, zero = qp.choose_qparams_affine(w, qp.MappingType.SYMMETRIC, (1, 128), torch.int8)
    codes = qp.quantize_affine(w, (1, 128), scale, zero, torch.int8)
    ours = Int8Linear(linear(96, 128))
    assert torch.equal(ours.scales, scale)
    assert torch.equal(ours.qweight, codes)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_matches_torchao_tinygemm_bit_for_bit(group_size):
    """Scales, zeros and codes equal torchao's tinygemm int4 qparams (Int4WeightOnlyConfig's math),
    and so does the dequantised weight."""
    qp = _torchao_primitives()
    if not hasattr(qp, "_choose_qparams_affine_tinygemm"):
        pytest.skip("this torchao has no tinygemm int4 primitives")
    w = linear(96, 256).weight.detach()
    block = (1, group_size)
    scale, zero = qp._choose_qparams_affine_tinygemm(w, qp.MappingType.ASYMMETRIC, block, torch.int32, 0, 15)
    codes = qp._quantize_affine_tinygemm(w, block, scale, zero, torch.int32, 0, 15)
    ours = Int4Linear(linear(96, 256), group_size)
    sz = ours.scales_and_zeros[:, :96]
    assert torch.equal(sz[..., 0].T, scale.view(96, -1))
    assert torch.equal(sz[..., 1].T, zero.view(96, -1))
    assert torch.equal(unpack_int4(ours.qweight)[:96].long(), codes.long())
    theirs = qp._dequantize_affine_tinygemm(codes, block, scale, zero, torch.int32, 0, 15, output_dtype=torch.float32)
    assert torch.equal(ours.dequantize(), theirs)


def test_int4_kernel_runs_only_where_the_layout_is_this_cpus():
    layer = Int4Linear(linear(64, 64, dtype=torch.bfloat16), 32)
    assert layer.kernel_ok == int4_layout_is_native()


@pytest.mark.skipif(not int4_layout_is_native(), reason="this CPU's int4 kernel reads another layout (AVX2 only)")
def test_int4_layout_is_what_torch_cpu_kernel_packs():
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (192, 96))
    packed = pack_int4(codes)
    assert torch.equal(packed, torch._convert_weight_to_int4pack_for_cpu(codes.int(), 1))
    assert torch.equal(unpack_int4(packed).long(), codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantisation_error_is_within_half_a_step(dtype):
    layer = linear(100, 128, dtype=dtype)
    w = layer.weight.detach().float()
    q8 = Int8Linear(layer)
    step8 = q8.scales.float()[:, None]
    # The absmax lands on 127.5 and is clamped to 127: exactly half a step, plus float32 rounding.
    assert ((q8.dequantize() - w).abs() <= step8 / 2 + 1e-6 * w.abs() + 1e-12).all()
    assert torch.equal(q8.dequantize()[3], torch.zeros(128))  # zero rows stay exactly zero
    for g in (32, 64):
        q4 = Int4Linear(layer, g)
        step4 = q4.scales_and_zeros[:, :100, 0].float().T.repeat_interleave(g, dim=1)
        # A bf16 zero point is rounded, which shifts the group by up to half its ulp (2^-9 relative).
        slack = 0 if dtype == torch.float32 else w.abs().view(100, -1, g).amax(-1).repeat_interleave(g, 1) * 2**-8
        assert ((q4.dequantize() - w).abs() <= step4 / 2 * (1 + 1e-5) + slack + 1e-7).all(), g
        assert (q4.dequantize()[5, :32] - 0.7).abs().max() <= (0.7 * 2**-8 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("n_out", [96, 128])  # 96: rows padded to a multiple of 64 for int4
def test_kernel_path_equals_dequantised_matmul(scheme, n_out):
    """In bf16 the forward runs torch's int8/int4 kernels; they must compute x @ dequant(W)^T + b."""
    layer = linear(n_out, 128, bias=True, dtype=torch.bfloat16)
    q = Int8Linear(layer) if scheme == "int8" else Int4Linear(layer, 32)
    x = torch.randn(2, 5, 128, dtype=torch.bfloat16)
    ref = F.linear(x.float(), q.dequantize(), layer.bias.float())
    out = q(x)
    assert out.shape == (2, 5, n_out) and out.dtype == torch.bfloat16
    # bf16 activations and output: errors of a few bf16 ulps of the largest output.
    assert (out.float() - ref).abs().max() <= 2e-2 * ref.abs().max()
    # The float32 path dequantises: exact up to float32 rounding.
    q32 = Int8Linear(layer.float()) if scheme == "int8" else Int4Linear(layer.float(), 32)
    assert torch.allclose(q32(x.float()), F.linear(x.float(), q32.dequantize(), layer.bias.float()), atol=1e-6)


def test_int8_inputs_not_multiple_of_16_fall_back_to_dequantising():
    # torch's int8 kernel computes wrong values for such widths (and can crash); those layers dequantise.
    layer = linear(40, 72, dtype=torch.bfloat16)
    q = Int8Linear(layer)
    assert not q.kernel_ok
    x = torch.randn(3, 72, dtype=torch.bfloat16)
    assert torch.allclose(q(x).float(), F.linear(x, q.dequantize(torch.bfloat16)).float())


@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", 32), ("int4", 64), ("nf4", 64)])
def test_quantize_model_replaces_every_linear_and_logits_stay_close(scheme, group_size):
    model = small_model()
    tokens = torch.randint(0, 320, (2, 20))
    with torch.no_grad():
        ref = model(tokens)
    before = model_bytes(model)
    quantize_model(model, scheme, group_size)
    kinds = {"int8": Int8Linear, "int4": Int4Linear, "nf4": NF4Linear}[scheme]
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.output, kinds) and isinstance(model.layers[1].ffn.w3, kinds)
    assert isinstance(model.tok_embeddings, nn.Embedding)
    # The same model with every quantised layer's dequantised weight put back into a plain Linear.
    plain = small_model()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, kinds):
                plain.get_submodule(name).weight.copy_(module.dequantize())
        out, expected = model(tokens), plain(tokens)
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5)
    # The price of quantising this random model: ~2% of the logits' norm for int8, ~25-30% for 4 bits.
    tolerance = {"int8": 0.04, "int4": 0.4, "nf4": 0.4}[scheme]
    assert (out - ref).norm() / ref.norm() < tolerance
    assert model_bytes(model) < before
    bits = quantized_bits_per_param(model)
    if scheme == "int8":  # one float32 scale per row of 64 or more inputs
        assert 8 < bits <= 8 + 32 / 64
    else:  # a float32 scale (and zero) per group; int4 pads the 320-row head to 384 rows
        expected = 4 + 64 / group_size if scheme == "int4" else 4.127
        assert expected <= bits < expected * 1.12


def test_quantize_model_options_and_errors():
    model = quantize_model(small_model(), "int8", include_output=False)
    assert type(model.output) is nn.Linear
    tied = quantize_model(small_model(tie_embeddings=True), "int8")
    assert tied.output is None and isinstance(tied.tok_embeddings, nn.Embedding)
    with pytest.raises(ConfigError, match="scheme"):
        quantize_model(small_model(), "int3")
    with pytest.raises(ConfigError, match="group_size"):
        quantize_model(small_model(), "int8", group_size=64)
    with pytest.raises(ConfigError, match="group_size"):
        quantize_model(small_model(), "int4", group_size=48)
    with pytest.raises(ConfigError, match="not a multiple of group_size 128"):
        quantize_model(small_model(), "int4", group_size=128)  # dim 64 < 128


@pytest.mark.parametrize("scheme", ["int8", "int4", "nf4"])
def test_engine_on_a_quantised_model_equals_uncached_greedy(scheme):
    """float32 (dequantising path): the cached engine gives the uncached reference's greedy tokens."""
    model = quantize_model(small_model(), scheme)
    prompt = [3, 14, 15, 92, 65]
    assert Engine(model).generate([prompt], 12, temperature=0)[0].ids == reference_generate(
        model, prompt, 12, temperature=0
    )


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_engine_on_a_quantised_bf16_model_follows_the_full_forward(scheme):
    """bf16 (kernel path): each cached greedy token is the full forward's argmax, up to bf16 noise
    between the two computations."""
    model = quantize_model(small_model().to(torch.bfloat16), scheme)
    prompt = [3, 14, 15, 92, 65]
    out = Engine(model).generate([prompt], 12, temperature=0)[0].ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out]))[0, len(prompt) - 1 : -1].float()
    top = logits.max(dim=-1).values
    chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
    assert ((top - chosen) <= 0.05 * top.abs().clamp(min=1)).all()


def test_prepacking_where_onednn_has_no_bf16_is_a_named_error(monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    model = small_model().to(torch.bfloat16)
    with pytest.raises(ConfigError, match="prepack.*no oneDNN bf16"):
        prepack_model(model)
    assert isinstance(model.layers[0].attn.wqkv, nn.Linear)  # nothing was replaced


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 kernels on this CPU (AVX2 only)"
)
def test_prepacked_bf16_is_bit_identical():
    model = small_model().to(torch.bfloat16)
    tokens = torch.randint(0, 320, (2, 9))
    with torch.no_grad():
        ref = model(tokens)
        prepack_model(model)
        out = model(tokens)
    assert isinstance(model.layers[0].attn.wqkv, PackedLinear)
    assert torch.equal(out, ref)


def test_prepacking_refuses_float16_and_leaves_the_model_whole():
    model = small_model().to(torch.float16)
    with pytest.raises(ConfigError, match="bfloat16 or float32.*float16 on cpu") as err:
        prepack_model(model)
    assert err.value.key == "dtype"
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def kernels_run(layer, x):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
        layer(x)
    return {event.key for event in prof.key_averages()}


def test_prepacked_fp32_runs_onednn_at_one_row_and_at_several():
    """The packed kernel, never torch's own matmul, at one row (batch-1 decode) and at several (the
    server's batched steps), close to F.linear but not bit-identical (oneDNN, not MKL)."""
    plain = linear(96, 128, bias=True)
    packed = PackedLinear(plain)
    for x in (torch.randn(1, 1, 128), torch.randn(3, 5, 128)):
        with torch.no_grad():
            torch.testing.assert_close(packed(x), plain(x), atol=1e-5, rtol=1e-5)
        kernels = kernels_run(packed, x)
        assert "mkldnn::_linear_pointwise" in kernels and not {"aten::mm", "aten::addmm"} & kernels, kernels


def test_prepacked_fp32_model_needs_no_onednn_bf16_and_decodes_the_same_tokens(monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # an AVX2 CPU
    model = small_model()
    prompts = [[3, 14, 15, 92, 65], [2, 7, 1, 8]]
    kwargs = dict(max_new_tokens=12, temperature=0)
    tokens = torch.randint(0, 320, (2, 9))
    with torch.no_grad():
        ref, ref_ids = model(tokens), [r.ids for r in Engine(model).generate(prompts, **kwargs)]
        prepack_model(model)
        out = model(tokens)
    assert isinstance(model.layers[0].attn.wqkv, PackedLinear) and model.layers[0].attn.wqkv.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert [r.ids for r in Engine(model).generate(prompts, **kwargs)] == ref_ids


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 kernels on this CPU (AVX2 only)"
)
def test_the_packed_linear_ops_shape_function_agrees_with_the_op():
    """Under torch.compile a PackedLinear is the kiln::packed_linear op, traced through its shape
    function: that must give the layer's dtype, not the input's (float32 activations into bf16
    weights come out bf16), or the compiled graph is wrong about every tensor after it."""
    for dtype in (torch.bfloat16, torch.float32):
        packed = PackedLinear(linear(96, 128, dtype=dtype))
        for x in (torch.randn(4, 128), torch.randn(2, 3, 128).to(dtype)):
            torch.library.opcheck(torch.ops.kiln.packed_linear.default, (x, packed.key), test_utils="test_faketensor")


def test_int4_on_an_avx2_only_cpu_prints_a_note(monkeypatch, capsys):
    """torch's int4 CPU kernel measured ~22x slower than fp32 at one row on an AVX2-only Zen 3: the
    loader says so there (and quantises all the same), and nowhere else."""
    from kiln.infer.load import InferenceOptions, quantize

    for capability, noted in (("AVX2", True), ("AVX512", False)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        quantize(small_model(), InferenceOptions(quant="int4", group_size=32))
        assert ("note: --quant int4 on an AVX2-only CPU" in capsys.readouterr().err) is noted
    quantize(small_model(), InferenceOptions(quant="int8"))
    assert "note:" not in capsys.readouterr().err
