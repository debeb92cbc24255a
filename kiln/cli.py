"""The `kiln` command. Each verb is a thin call into the package."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kiln.data.tokenizer import find_tokenizer
from kiln.errors import ConfigError, DataError, TrainingDiverged


def _recipe_args(p: argparse.ArgumentParser, stage_verb: bool = True) -> None:
    p.add_argument("recipe", nargs="?", default="recipes/tiny.toml", help="TOML recipe (default: recipes/tiny.toml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 model.n_layers=6")
    if stage_verb:
        p.add_argument("--force", action="store_true", help="rebuild even if the stage is already done")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Train language models end to end.")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = verbs.add_parser("run", help="run the stages a recipe names, skipping finished ones")
    _recipe_args(p)
    p.add_argument("--stages", help="comma-separated subset of stages to run")

    p = verbs.add_parser("corpus", help="build the built-in corpus of real text")
    _recipe_args(p)

    p = verbs.add_parser("data", help="curate documents: filter, deduplicate, scrub (runs the data stage)")
    _recipe_args(p)

    p = verbs.add_parser("classifier", help="train the data quality classifier used by the quality_classifier step")
    act = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = act.add_parser("train", help="reference documents (positive) vs raw documents (negative)")
    c.add_argument("--positive", nargs="+", required=True, help="files/folders/globs of reference documents")
    c.add_argument("--negative", nargs="+", required=True, help="files/folders/globs of raw documents")
    c.add_argument("--out", required=True, help="model file to write (.safetensors, with a .json sidecar)")

    p = verbs.add_parser("tokenizer", help="train a byte-level BPE tokenizer")
    tok = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    _recipe_args(tok.add_parser("train", help="train on the run's corpus"))

    p = verbs.add_parser("pack", help="tokenize the corpus into memory-mapped token shards")
    _recipe_args(p)

    p = verbs.add_parser("pretrain", help="pretrain the model on the packed shards")
    _recipe_args(p)
    p.add_argument("--resume", default="auto", help="auto (newest complete checkpoint), none, or a checkpoint path")
    p.add_argument("--init-from", help="start a new run from this checkpoint's weights")

    for verb, what in (
        ("sft", "supervised fine-tuning on conversations and the verifiable tasks"),
        ("rm", "reward model: the transformer with a scalar head, Bradley-Terry on pairs"),
        ("dpo", "direct preference optimisation (sigmoid, IPO or conservative DPO)"),
        ("ppo", "PPO: actor, critic, frozen reference, verifier or reward-model reward"),
        ("grpo", "group-relative policy optimisation with the task verifiers as rewards"),
        ("distill", "distillation from a teacher checkpoint: generated data and soft targets"),
    ):
        p = verbs.add_parser(verb, help=what)
        _recipe_args(p)
        p.add_argument("--resume", default="auto", help="auto (newest complete checkpoint), none, or a path")
        p.add_argument("--init-from", help="start from this checkpoint instead of the previous stage's")

    p = verbs.add_parser("generate", help="sample text from a checkpoint")
    p.add_argument("checkpoint", help="checkpoint folder, checkpoints root, or stage folder")
    p.add_argument("--prompt", default="def ")
    p.add_argument("--tokenizer", help="tokenizer.json (default: found next to the checkpoint)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--num-samples", type=int, default=1, help="completions of the prompt, generated as one batch")
    p.add_argument("--seed", type=int, default=0, help="sample i uses seed + i")
    from kiln.serve.cli import add_inference_args

    add_inference_args(p)
    p.add_argument("--draft", help="draft checkpoint for speculative decoding (same tokenizer, smaller model)")
    p.add_argument("--draft-tokens", type=int, default=4, help="tokens the draft proposes per step")

    p = verbs.add_parser("export", help="export a checkpoint to another format")
    fmt = p.add_subparsers(dest="format", required=True, metavar="FORMAT")
    e = fmt.add_parser("hf", help="Hugging Face folder (LlamaForCausalLM) that transformers and vLLM load")
    e.add_argument("checkpoint")
    e.add_argument("out")
    e.add_argument("--tokenizer", help="tokenizer.json (default: found next to the checkpoint)")

    e = fmt.add_parser("single", help="one-file checkpoint (model.safetensors + manifest), e.g. from a sharded one")
    e.add_argument("checkpoint")
    e.add_argument("out")

    p = verbs.add_parser("import", help="import a checkpoint from another format")
    fmt = p.add_subparsers(dest="format", required=True, metavar="FORMAT")
    i = fmt.add_parser("hf", help="local Llama / Mistral / Qwen2 folder into a Kiln checkpoint")
    i.add_argument("folder")
    i.add_argument("out")

    from kiln.parallel.launch import add_launch_parser
    from kiln.parallel.plan_cli import add_plan_parser

    add_launch_parser(verbs)
    add_plan_parser(verbs)
    from kiln.report import add_report_parser

    add_report_parser(verbs)
    from kiln.serve.cli import add_serve_parsers

    add_serve_parsers(verbs)
    from kiln.eval.cli import add_eval_parser

    add_eval_parser(verbs)
    from kiln.sweep import add_parser as add_sweep_parser

    add_sweep_parser(verbs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except (ConfigError, DataError, FileNotFoundError) as err:
        print(f"kiln: error: {err}", file=sys.stderr)
        return 2
    except TrainingDiverged as err:
        print(f"kiln: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    from kiln.pipeline import run_recipe
    from kiln.recipe import POST_STAGES, STAGES, load_recipe

    stage_of_verb = {
        "corpus": "corpus",
        "data": "data",
        "tokenizer": "tokenizer",
        "pack": "pack",
        "pretrain": "pretrain",
        **{stage: stage for stage in POST_STAGES},
    }
    if args.verb in ("run", *stage_of_verb) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Started by torchrun (directly, or through `kiln launch`, Slurm or Kubernetes): join the job.
        import torch

        from kiln.parallel.dims import init_distributed

        init_distributed("cuda" if torch.cuda.is_available() else "cpu")
    if args.verb == "run":
        recipe = load_recipe(args.recipe, args.overrides)
        stages = args.stages.split(",") if args.stages else None
        results = run_recipe(recipe, stages, force=args.force)
        print(f"run folder: {recipe.run_dir}")
        if "pretrain" in results:
            summary = results["pretrain"]
            print(
                "pretrain summary: "
                + json.dumps(
                    {
                        k: summary.get(k)
                        for k in (
                            "steps",
                            "tokens_seen",
                            "final_val_loss",
                            "best_val_loss",
                            "final_val_bpb",
                            "tokens_per_s",
                            "mfu",
                        )
                    }
                )
            )
        return 0
    if args.verb in stage_of_verb:
        recipe = load_recipe(args.recipe, args.overrides)
        extra = {"resume": args.resume, "init_from": args.init_from} if hasattr(args, "init_from") else {}
        target = stage_of_verb[args.verb]
        # Unfinished upstream stages of the recipe run first (finished ones are skipped), so any verb
        # works on a fresh run folder. Curating explicit inputs needs no corpus.
        upstream = [s for s in recipe.run.stages if STAGES.index(s) < STAGES.index(target)]
        if target == "data" and recipe.data.inputs:
            upstream = []
        if upstream:
            run_recipe(recipe, upstream)
        run_recipe(recipe, [target], force=args.force, **extra)
        return 0
    if args.verb == "classifier":
        from kiln.data.classifier import train_from_files

        stats = train_from_files(args.positive, args.negative, args.out)
        print(json.dumps(stats, indent=1))
        return 0
    if args.verb == "launch":
        from kiln.parallel.launch import run_launch
        from kiln.recipe import load_recipe

        # The whole recipe is validated before a job is submitted; a path that exists only on the
        # cluster is passed through.
        parallel = load_recipe(args.recipe, args.overrides).parallel if Path(args.recipe).is_file() else None
        return run_launch(args, parallel)
    if args.verb == "eval":
        from kiln.eval.cli import run_eval

        return run_eval(args)
    if args.verb == "serve":
        from kiln.serve.cli import run_serve

        return run_serve(args)
    if args.verb == "chat":
        from kiln.serve.cli import run_chat

        return run_chat(args)
    if args.verb == "report":
        from kiln.report import run_report

        return run_report(args)
    if args.verb == "plan":
        from kiln.parallel.plan_cli import run_plan

        return run_plan(args)
    if args.verb == "sweep":
        from kiln.sweep import main as sweep_main

        return sweep_main(args)
    if args.verb == "generate":
        return _generate(args)
    if args.verb == "export" and args.format == "single":
        from kiln.checkpoint import save_weights
        from kiln.model.weights import load_weights

        cfg, state, manifest = load_weights(args.checkpoint)
        save_weights(args.out, cfg, state, {"step": manifest.get("step"), "converted_from": str(args.checkpoint)})
        print(f"wrote {args.out}/model.safetensors ({len(state)} tensors, step {manifest.get('step')})")
        return 0
    if args.verb == "export":
        from kiln.hf import export_checkpoint_to_hf

        tokenizer = Path(args.tokenizer) if args.tokenizer else find_tokenizer(args.checkpoint)
        export_checkpoint_to_hf(args.checkpoint, tokenizer, args.out)
        print(f"exported {args.checkpoint} -> {args.out}")
        return 0
    if args.verb == "import":
        from kiln.hf import import_hf_to_checkpoint

        import_hf_to_checkpoint(args.folder, args.out)
        print(f"imported {args.folder} -> {args.out}")
        return 0
    raise AssertionError(args.verb)


def _generate(args: argparse.Namespace) -> int:
    """num_samples completions of the prompt with the KV-cache engine (speculative with --draft),
    each printed after the prompt. The prompt follows <|endoftext|>, so the model reads it as the
    start of a document, as pretraining data lays documents out."""
    from kiln.infer.config import SampleConfig
    from kiln.infer.engine import Engine
    from kiln.infer.load import load_draft
    from kiln.infer.speculative import SpeculativeEngine
    from kiln.serve.cli import load_for_inference

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
    model, tokenizer = load_for_inference(args)
    prompt_tokens = tokenizer.encode(args.prompt)
    prompt = [tokenizer.eot_id] + prompt_tokens
    max_new = min(args.max_new_tokens, model.cfg.max_seq_len - len(prompt))
    if max_new < 1:
        raise ConfigError(
            "--prompt",
            f"{len(prompt)} tokens leave no room in the model's context of {model.cfg.max_seq_len}",
            "<command line>",
        )
    kwargs = dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop_token_ids=[tokenizer.eot_id],
        seed=args.seed,
    )
    try:
        if args.draft:
            engine = SpeculativeEngine(
                model, load_draft(args.draft, model, args.draft_tokens), tokenizer, k=args.draft_tokens
            )
        else:
            engine = Engine(model, tokenizer)
        outs = engine.generate([prompt] * args.num_samples, max_new, **kwargs)
    except ConfigError as err:
        flag = {"draft": "--draft", "k": "--draft-tokens"}.get(err.key, "--" + err.key.replace("_", "-"))
        raise ConfigError(flag, err.message, "<command line>") from None
    prompt_text = tokenizer.decode(prompt_tokens)
    for out in outs:
        ids = out.ids[:-1] if out.stop == tokenizer.eot_id else out.ids
        # Decoding prompt and completion together keeps a character whose bytes straddle the boundary
        # whole; the prompt's own text is then cut off the front.
        full = tokenizer.decode(prompt_tokens + ids)
        print(args.prompt + (full[len(prompt_text) :] if full.startswith(prompt_text) else tokenizer.decode(ids)))
    if args.draft:
        stats = engine.stats
        print(
            f"speculative decoding: {stats.accepted}/{stats.proposed} proposals kept "
            f"({stats.acceptance_rate:.0%}), {stats.target_calls} target forwards for {stats.tokens} tokens",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
