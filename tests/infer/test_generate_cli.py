"""`kiln generate` and `kiln serve` with --quant/--group-size and (generate) --draft/--draft-tokens,
run through the command line on a tiny checkpoint and compared with the library calls they stand for."""

import argparse
import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kiln_testing.reference_generate import reference_generate

from kiln.checkpoint import save_weights
from kiln.cli import build_parser, main
from kiln.infer.config import SampleConfig
from kiln.infer.engine import Engine
from kiln.infer.quant import QUANTIZED_TYPES, PackedLinear, quantize_model
from kiln.infer.samples import sample_texts
from kiln.model import ModelConfig, build_model

PROMPT = "def main("
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory, kiln_tokenizer):
    """A target checkpoint, a smaller draft with the same tokenizer, and one with another vocabulary."""
    root = tmp_path_factory.mktemp("gen_cli")
    tok = kiln_tokenizer
    out = {"tok": tok}
    for name, seed, overrides in (
        ("target", 0, dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2)),
        ("draft", 1, dict(dim=32, n_layers=1, n_heads=2, n_kv_heads=1)),
        ("other_vocab", 2, dict(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=tok.vocab_size + 64)),
    ):
        torch.manual_seed(seed)
        cfg = ModelConfig(**{"vocab_size": tok.vocab_size, "max_seq_len": 96, "init_std": 0.2, **overrides})
        model = build_model(cfg).eval()
        path = save_weights(root / name, cfg, model.state_dict(), {"step": 0})
        shutil.copy(tok.path, Path(path) / "tokenizer.json")
        out[name], out[name + "_model"] = Path(path), model
    return out


def generated(capsys, argv) -> str:
    capsys.readouterr()
    assert main(["generate", *map(str, argv)]) == 0
    return capsys.readouterr().out


def reference(model, tok, n=12) -> str:
    """What `kiln generate --temperature 0` prints, from the uncached reference sampler."""
    prompt = tok.encode(PROMPT)
    new = reference_generate(model, [tok.eot_id] + prompt, n, temperature=0, stop_ids=[tok.eot_id])
    return PROMPT + tok.decode(prompt + new)[len(tok.decode(prompt)) :] + "\n"


def test_generate_prints_the_sample_stages_texts(run, capsys):
    """The sample stage and `kiln generate` are one generator: same settings and seed, same texts."""
    cfg = SampleConfig(prompt=PROMPT, max_new_tokens=10, num_samples=3, seed=5)
    texts = sample_texts(run["target_model"], run["tok"], cfg)
    args = [run["target"], "--prompt", PROMPT, "--max-new-tokens", 10, "--num-samples", 3, "--seed", 5]
    assert generated(capsys, args) == "".join(f"{PROMPT}{text}\n" for text in texts)


def test_generate_greedy_equals_the_uncached_reference(run, capsys):
    out = generated(capsys, [run["target"], "--prompt", PROMPT, "--max-new-tokens", 12, "--temperature", 0])
    assert out == reference(run["target_model"], run["tok"])
    # Sampling: each sample is seeded seed + i, so a rerun repeats them and samples differ.
    args = [
        run["target"],
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        12,
        "--temperature",
        1.0,
        "--top-k",
        0,
        "--top-p",
        1.0,
        "--num-samples",
        3,
        "--seed",
        5,
    ]
    first = generated(capsys, args)
    assert first == generated(capsys, args) and len(set(first.splitlines())) > 1


@pytest.mark.parametrize("quant,group", [("int8", None), ("int4", 32), ("nf4", None)])
def test_generate_quantised_equals_the_engine_on_the_same_quantised_model(run, capsys, quant, group):
    extra = ["--group-size", group] if group else []
    out = generated(
        capsys,
        [run["target"], "--prompt", PROMPT, "--max-new-tokens", 12, "--temperature", 0, "--quant", quant, *extra],
    )
    tok = run["tok"]
    # --dtype auto with --quant is bfloat16, where the CPU kernels read the int8/int4 codes.
    model = quantize_model(copy.deepcopy(run["target_model"]).to(torch.bfloat16), quant, group)
    ours = Engine(model, tok).generate(
        [[tok.eot_id] + tok.encode(PROMPT)], 12, temperature=0, stop_token_ids=[tok.eot_id]
    )[0]
    ids = ours.ids[:-1] if ours.stop == tok.eot_id else ours.ids
    prompt = tok.encode(PROMPT)
    assert out == PROMPT + tok.decode(prompt + ids)[len(tok.decode(prompt)) :] + "\n"


def test_serve_and_chat_load_the_model_quantised(run):
    from kiln.serve.cli import load_for_inference

    parser = build_parser()
    for verb in ("serve", "chat"):
        args = parser.parse_args([verb, str(run["target"]), "--quant", "int4", "--group-size", "64"])
        model, _ = load_for_inference(args)
        layers = [m for m in model.modules() if isinstance(m, QUANTIZED_TYPES)]
        assert len(layers) == 2 * 5 + 1  # qkv, out, gate, up, down per block, and the untied head
        assert next(model.parameters()).dtype == torch.bfloat16
    args = parser.parse_args(["serve", str(run["target"]), "--quant", "int8", "--dtype", "float32"])
    model, _ = load_for_inference(args)
    assert next(model.parameters()).dtype == torch.float32
    assert any(isinstance(m, QUANTIZED_TYPES) for m in model.modules())


def test_served_quantised_model_answers_as_the_engine(run):
    from fastapi.testclient import TestClient

    from kiln.serve.app import create_app
    from kiln.serve.cli import load_for_inference

    args = build_parser().parse_args(["serve", str(run["target"]), "--quant", "int8"])
    model, tok = load_for_inference(args)
    with TestClient(create_app(model, tok, model_name="q")) as client:
        body = client.post(
            "/v1/completions",
            json={"model": "q", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True},
        ).json()
    expected = Engine(model, tok).generate([PROMPT], 10, temperature=0)[0]
    assert body["choices"][0]["text"] == expected.text


@pytest.mark.parametrize("k", [1, 3])
def test_generate_with_a_draft_keeps_greedy_output(run, capsys, k):
    base = [run["target"], "--prompt", PROMPT, "--max-new-tokens", 16, "--temperature", 0]
    plain = generated(capsys, base)
    capsys.readouterr()
    assert main(["generate", *map(str, base), "--draft", str(run["draft"]), "--draft-tokens", str(k)]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain
    assert "speculative decoding:" in captured.err and "target forwards" in captured.err
    # The target drafting for itself keeps every proposal.
    assert main(["generate", *map(str, base), "--draft", str(run["target"]), "--draft-tokens", str(k)]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain and "(100%)" in captured.err


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--quant", "int4", "--group-size", "128"], "--group-size"),  # the FFN width 192 is no multiple of 128
        (["--quant", "int4", "--group-size", "48"], "--group-size"),
        (["--group-size", "64"], "--group-size"),  # without --quant
        (["--draft-tokens", "0", "--draft", "DRAFT"], "--draft-tokens"),
        (["--draft", "OTHER"], "--draft"),  # another vocabulary
        (["--temperature", "-1"], "--temperature"),
        (["--compile-decode", "--draft", "DRAFT"], "--compile-decode"),
        (["--prepack", "--quant", "int8"], "--prepack"),
        (["--prepack", "--dtype", "float16"], "--prepack"),
    ],
)
def test_bad_flags_are_named(run, capsys, argv, flag):
    argv = [{"DRAFT": str(run["draft"]), "OTHER": str(run["other_vocab"])}.get(a, a) for a in argv]
    capsys.readouterr()
    assert main(["generate", str(run["target"]), "--max-new-tokens", "4", *argv]) == 2
    err = capsys.readouterr().err
    assert f"{flag}:" in err, err


def test_prepack_on_a_cpu_without_onednn_bf16_packs_float32_or_names_the_asked_bf16(run, capsys, monkeypatch):
    """An AVX2-only CPU: --dtype auto packs float32 (and says so); an explicit bfloat16 is one named line."""
    from kiln.serve.cli import load_for_inference

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    capsys.readouterr()
    packed, _ = load_for_inference(build_parser().parse_args(["serve", str(run["target"]), "--prepack"]))
    layers = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.dtype == torch.float32 for m in layers)
    assert "--dtype auto with --prepack: float32" in capsys.readouterr().err
    argv = ["generate", str(run["target"]), "--max-new-tokens", "4", "--prepack", "--dtype", "bfloat16"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--prepack:" in err and "no oneDNN bf16" in err and "Traceback" not in err, err


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 kernels on this CPU (AVX2 only)"
)
def test_generate_prepacked_prints_the_bf16_text(run, capsys):
    argv = [run["target"], "--prompt", PROMPT, "--max-new-tokens", 12, "--temperature", 0]
    assert generated(capsys, [*argv, "--prepack"]) == generated(capsys, [*argv, "--dtype", "bfloat16"])
    args = build_parser().parse_args(["serve", str(run["target"]), "--prepack"])
    from kiln.serve.cli import load_for_inference

    packed, _ = load_for_inference(args)
    assert any(isinstance(m, PackedLinear) for m in packed.modules())


def test_generate_prepacked_in_float32_prints_the_float32_text(run, capsys):
    """fp32 prepacking differs from F.linear by ~1e-6 relative, far below any gap between the greedy
    choices of this model."""
    argv = [run["target"], "--prompt", PROMPT, "--max-new-tokens", 12, "--temperature", 0, "--dtype", "float32"]
    assert generated(capsys, [*argv, "--prepack"]) == generated(capsys, argv)
    from kiln.serve.cli import load_for_inference

    packed, _ = load_for_inference(
        build_parser().parse_args(["serve", str(run["target"]), "--prepack", "--dtype", "float32"])
    )
    layers = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.dtype == torch.float32 for m in layers)


def test_serve_refuses_compile_decode_by_name(run, capsys):
    """Continuous batching changes the batch between steps, so the static-shape step cannot serve it."""
    capsys.readouterr()
    assert main(["serve", str(run["target"]), "--compile-decode"]) == 2
    err = capsys.readouterr().err
    assert "--compile-decode:" in err and "continuous batching" in err, err


@pytest.mark.slow
def test_generate_compile_decode_prints_the_eager_text(run, capsys):
    """inductor compiles the step (~20-60 s on a shared 2-core machine)."""
    argv = [run["target"], "--prompt", PROMPT, "--max-new-tokens", 12, "--temperature", 0, "--num-samples", 2]
    assert generated(capsys, [*argv, "--compile-decode"]) == generated(capsys, argv)


def test_serve_refuses_bad_quant_flags_before_starting(run):
    from kiln.errors import ConfigError
    from kiln.serve.cli import load_for_inference

    args = argparse.Namespace(
        checkpoint=str(run["target"]), tokenizer=None, device="cpu", dtype="auto", quant="int4", group_size=100
    )
    with pytest.raises(ConfigError, match="--group-size"):
        load_for_inference(args)


def test_a_prompt_that_is_not_utf8_is_one_line_naming_the_flag(run, tmp_path):
    """A byte outside UTF-8 on the command line reaches Python as a lone surrogate (surrogateescape),
    which the tokenizer cannot encode: one line naming --prompt, not a traceback."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln.cli",
            "generate",
            str(run["target"]),
            "--max-new-tokens",
            "2",
            "--prompt",
            b"caf\xe9",
        ],
        cwd=REPO,
        env={**os.environ, "LC_ALL": "C.UTF-8", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr
    assert "--prompt: is not UTF-8 text" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
