"""Loading a checkpoint for inference as the command-line verbs do it (`kiln generate`, `kiln serve`,
`kiln chat`): device and dtype, optional weight-only quantisation (kiln.infer.quant) and an optional
draft model for speculative decoding (kiln.infer.speculative).

These options say how a model is loaded and run, never how tokens are sampled: that is
kiln.infer.config.SamplingParams. Errors name the command-line flag, since that is what the user typed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from kiln.checkpoint import loaded_line, resolve_checkpoint
from kiln.data.tokenizer import Tokenizer, find_tokenizer
from kiln.errors import ConfigError
from kiln.infer.quant import onednn_packs_bf16, prepack_model, quantize_model
from kiln.peft.load import load_model

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANT_SCHEMES = ("int8", "int4", "nf4")


@dataclass
class InferenceOptions:
    """Where and in what precision the model runs (`--device`, `--dtype`, `--quant`, `--group-size`)."""

    device: str = "auto"  # auto: cuda when available
    dtype: str = "auto"  # auto: bfloat16 on a GPU or when quantising, float32 otherwise
    quant: str | None = None  # int8 | int4 | nf4
    group_size: int | None = None  # int4: 32/64/128/256 (default 64); nf4: block size (default 64)
    prepack: bool = False  # bf16/fp32 CPU weights reordered once into oneDNN's layout (kiln.infer.quant.prepack_model)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:
        raise ConfigError("--device", f"cannot use {name!r}: {err}", "<command line>") from None
    return device


def resolve_dtype(opts: InferenceOptions, device: torch.device) -> torch.dtype:
    if opts.dtype not in DTYPES:
        raise ConfigError("--dtype", f"must be one of {', '.join(DTYPES)}, got {opts.dtype!r}", "<command line>")
    return getattr(torch, _auto_dtype(opts, device) if opts.dtype == "auto" else opts.dtype)


def _auto_dtype(opts: InferenceOptions, device: torch.device) -> str:
    if device.type == "cuda":
        return "bfloat16"
    if opts.prepack:
        if onednn_packs_bf16():
            return "bfloat16"
        # oneDNN packs bf16 only with AVX512-BW/VL/DQ or AVX-NE-CONVERT; on an AVX2-only CPU packed
        # fp32 is what there is (and bf16 matmuls there run ~78x slower than fp32's, docs/benchmarks.md).
        print("note: --dtype auto with --prepack: float32, this CPU has no oneDNN bf16 kernels", file=sys.stderr)
        return "float32"
    # The CPU kernels that read int8/int4 codes directly take bf16 activations; with float32 the
    # quantised layers dequantise in every forward, which is slower than not quantising.
    return "bfloat16" if opts.quant else "float32"


def cpu_is_avx2_only() -> bool:
    """Whether torch's CPU kernels dispatch at AVX2 here: an x86 CPU without AVX-512."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


def quantize(model, opts: InferenceOptions):
    """Quantise (opts.quant) or prepack (opts.prepack) the model's linear layers in place; returns the model."""
    if opts.prepack:
        return prepack(model, opts)
    if opts.quant is None:
        if opts.group_size is not None:
            raise ConfigError("--group-size", "only applies with --quant int4 or nf4", "<command line>")
        return model
    if opts.quant not in QUANT_SCHEMES:
        raise ConfigError("--quant", f"must be one of {', '.join(QUANT_SCHEMES)}, got {opts.quant!r}", "<command line>")
    if opts.quant == "int4" and next(model.parameters()).device.type == "cpu" and cpu_is_avx2_only():
        # On the AVX2-only Zen 3 a 1024x1024 Int4Linear took 2.2 ms at one row against 0.1 ms in
        # fp32, while int8 ran 1.4-2.4x transformers' bf16 decode there (docs/benchmarks.md).
        print(
            "note: --quant int4 on an AVX2-only CPU: torch's int4 kernel ran ~22x slower than a float32 "
            "matmul on such a CPU; --quant int8 is the fast weight-only scheme here",
            file=sys.stderr,
        )
    try:
        return quantize_model(model, opts.quant, opts.group_size)
    except ConfigError as err:
        flag = "--group-size" if err.key == "group_size" else "--quant"
        raise ConfigError(flag, err.message, "<command line>") from None


def prepack(model, opts: InferenceOptions):
    """The bf16 or fp32 linears reordered once for oneDNN (kiln.infer.quant.PackedLinear)."""
    if opts.quant is not None:
        raise ConfigError(
            "--prepack", f"applies to unquantised weights, not with --quant {opts.quant}", "<command line>"
        )
    try:
        return prepack_model(model)
    except ConfigError as err:
        raise ConfigError("--prepack", err.message, "<command line>") from None


def load_for_inference(checkpoint, tokenizer_path=None, opts: InferenceOptions | None = None):
    """(model in eval mode on its device, in its dtype, quantised if asked; tokenizer)."""
    opts = opts or InferenceOptions()
    device = resolve_device(opts.device)
    dtype = resolve_dtype(opts, device)
    folder = resolve_checkpoint(checkpoint)
    model, manifest = load_model(folder)
    print(loaded_line(folder, manifest), file=sys.stderr)  # stderr: stdout is the generated text
    tokenizer = Tokenizer.load(tokenizer_path or find_tokenizer(checkpoint))
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ConfigError(
            "--tokenizer",
            f"{tokenizer.path} has {tokenizer.vocab_size} tokens but the model's vocabulary is {model.cfg.vocab_size}",
            "<command line>",
        )
    model = model.to(device=device, dtype=dtype).eval()
    return quantize(model, opts), tokenizer


def load_draft(checkpoint, target, k: int):
    """A SpeculativeEngine's draft: the checkpoint on the target's device and in its parameter dtype
    (never quantised: it is small by design). The engine checks the vocabulary and context."""
    if k < 1:
        raise ConfigError("--draft-tokens", f"must be >= 1, got {k}", "<command line>")
    draft, _ = load_model(checkpoint)
    param = next(p for p in target.parameters())
    dtype = param.dtype if param.is_floating_point() else torch.bfloat16
    return draft.to(device=param.device, dtype=dtype).eval()
