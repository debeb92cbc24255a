"""`kiln generate`: sample text from a checkpoint, and the inference flags it shares with `kiln serve`
and `kiln chat` (--device, --dtype, --quant, --group-size)."""

from __future__ import annotations

import argparse
import sys

from kiln.config import finite_float
from kiln.data.readers import has_lone_surrogate
from kiln.errors import ConfigError
from kiln.infer.config import SampleConfig
from kiln.infer.engine import Engine
from kiln.infer.load import InferenceOptions, load_draft
from kiln.infer.load import load_for_inference as load
from kiln.infer.samples import sample_texts
from kiln.infer.speculative import SpeculativeEngine


def add_inference_args(p: argparse.ArgumentParser) -> None:
    """--device, --dtype, --quant, --group-size and --prepack, shared with `kiln serve` and `kiln chat`."""
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="auto: bfloat16 on a GPU or with --quant, float32 otherwise",
    )
    p.add_argument(
        "--quant",
        choices=("int8", "int4", "nf4"),
        help="weight-only quantisation of the linear layers (docs/inference.md#quantisation)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        help="int4: 32, 64, 128 or 256 inputs per scale (default 64); nf4: block size (default 64)",
    )
    p.add_argument(
        "--prepack",
        action="store_true",
        help="CPU: reorder each weight once into oneDNN's layout; bf16 (what --dtype auto becomes where oneDNN "
        "has bf16 kernels, else float32): bit-identical, faster decode; float32: faster steps of 2+ rows",
    )


def add_compile_decode_arg(p: argparse.ArgumentParser) -> None:
    """--compile-decode, shared with `kiln chat` and `kiln serve` (which refuses it)."""
    p.add_argument(
        "--compile-decode",
        action="store_true",
        help="decode with a static-shape step compiled by torch.compile: faster per token, the first "
        "request pays the compile (docs/inference.md#compiled-decode)",
    )


def inference_options(args: argparse.Namespace) -> InferenceOptions:
    return InferenceOptions(
        device=getattr(args, "device", "auto"),
        dtype=getattr(args, "dtype", "auto"),
        quant=getattr(args, "quant", None),
        group_size=getattr(args, "group_size", None),
        prepack=getattr(args, "prepack", False),
    )


def load_for_inference(args: argparse.Namespace):
    """(model on its device, tokenizer) for --checkpoint/--tokenizer/--device/--dtype/--quant/--group-size."""
    return load(args.checkpoint, args.tokenizer, inference_options(args))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="sample text from a checkpoint")
    p.add_argument("checkpoint", help="checkpoint folder, checkpoints root, or stage folder")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--tokenizer", help="tokenizer.json (default: found next to the checkpoint)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=finite_float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=finite_float, default=0.95)
    p.add_argument("--num-samples", type=int, default=1, help="completions of the prompt, generated as one batch")
    p.add_argument("--seed", type=int, default=0, help="sample i uses seed + i")
    add_inference_args(p)
    p.add_argument("--draft", help="draft checkpoint for speculative decoding (same tokenizer, smaller model)")
    p.add_argument("--draft-tokens", type=int, default=4, help="tokens the draft proposes per step")
    add_compile_decode_arg(p)


def run(args: argparse.Namespace) -> int:
    """num_samples completions of the prompt with the KV-cache engine (speculative with --draft),
    each printed after the prompt. The prompt follows the tokenizer's bos (else its eos: Kiln's
    <|endoftext|>), so the model reads it as the start of a document, as pretraining data lays
    documents out."""
    if has_lone_surrogate(args.prompt):
        # Python hands a byte the locale cannot decode to argv as a lone surrogate (surrogateescape).
        raise ConfigError(
            "--prompt", "is not UTF-8 text (a byte outside UTF-8); pass the prompt as UTF-8", "<command line>"
        )
    cfg = SampleConfig(
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        num_samples=args.num_samples,
        seed=args.seed,
    )
    try:
        cfg.validate()
    except ConfigError as err:
        raise ConfigError("--" + err.key.replace("_", "-"), err.message, "<command line>") from None
    if args.compile_decode and args.draft:
        raise ConfigError(
            "--compile-decode",
            "does not apply to speculative decoding (--draft); use one or the other",
            "<command line>",
        )
    model, tokenizer = load_for_inference(args)
    try:
        if args.draft:
            engine = SpeculativeEngine(
                model, load_draft(args.draft, model, args.draft_tokens), tokenizer, k=args.draft_tokens
            )
        else:
            engine = Engine(model, tokenizer, compile_decode=args.compile_decode)
            if args.compile_decode:
                print("compiling the decode step (once per batch size and cache length)...", file=sys.stderr)
        texts = sample_texts(model, tokenizer, cfg, engine)
    except ConfigError as err:
        flag = {"draft": "--draft", "k": "--draft-tokens", "sample.prompt": "--prompt"}.get(
            err.key, "--" + err.key.replace("_", "-")
        )
        raise ConfigError(flag, err.message, "<command line>") from None
    for text in texts:
        print(args.prompt + text)
    if args.draft:
        stats = engine.stats
        print(
            f"speculative decoding: {stats.accepted}/{stats.proposed} proposals kept "
            f"({stats.acceptance_rate:.0%}), {stats.target_calls} target forwards for {stats.tokens} tokens",
            file=sys.stderr,
        )
    return 0
