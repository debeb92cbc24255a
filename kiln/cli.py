"""The `kiln` command: a table of verbs, each implemented in its own package.

A verb module defines `add_parser(subparsers)`, which registers its verb (or its verbs) with their
arguments and the help line the table gives, and `run(args) -> int`, which does the work and returns
the exit status. This file holds the table, `main` and the one-line error handling; a new verb is an
entry in VERBS plus those two functions in its package (docs/pipeline.md, "Adding a verb").
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import sys
from types import ModuleType
from typing import Iterable, NamedTuple

from kiln import __version__
from kiln.errors import ConfigError, DataError, TrainingDiverged, did_you_mean
from kiln.files import os_error_line


class Verb(NamedTuple):
    module: str  # the module whose add_parser registers the verb and whose run runs it
    help: str  # the line `kiln --help` shows, the same the module registers


# In the order `kiln --help` lists them. The verbs that read a recipe are kiln.pipeline_verbs's, on top of
# the layers: launch and plan get the recipe's sections from there and keep the rest in kiln.parallel.
VERBS: dict[str, Verb] = {
    "run": Verb("kiln.pipeline_verbs", "run the stages a recipe names, skipping finished ones"),
    "recipes": Verb("kiln.recipe_files", "list the recipes shipped with Kiln (run one by name: kiln run tiny)"),
    "init": Verb("kiln.recipe_files", "copy a packaged recipe out for editing (never overwrites a file)"),
    "corpus": Verb("kiln.pipeline_verbs", "build the built-in corpus of real text"),
    "data": Verb("kiln.pipeline_verbs", "curate documents: filter, deduplicate, scrub (runs the data stage)"),
    "classifier": Verb("kiln.data.classifier", "train the data quality classifier used by the quality_classifier step"),
    "tokenizer": Verb("kiln.pipeline_verbs", "train a tokenizer (byte-level BPE, or unigram with tokenizer.model)"),
    "pack": Verb("kiln.pipeline_verbs", "tokenize the corpus into memory-mapped token shards"),
    "pretrain": Verb("kiln.pipeline_verbs", "pretrain the model on the packed shards"),
    "sft": Verb("kiln.pipeline_verbs", "supervised fine-tuning on conversations and the verifiable tasks"),
    "judge": Verb(
        "kiln.post.judge",
        "RLAIF: an AI judge ranks two completions per prompt against a rubric; writes preference pairs",
    ),
    "rm": Verb("kiln.pipeline_verbs", "reward model: the transformer with a scalar head, Bradley-Terry on pairs"),
    "dpo": Verb("kiln.pipeline_verbs", "direct preference optimisation (sigmoid, IPO or conservative DPO)"),
    "ppo": Verb("kiln.pipeline_verbs", "PPO: actor, critic, frozen reference, verifier or reward-model reward"),
    "grpo": Verb("kiln.pipeline_verbs", "group-relative policy optimisation with the task verifiers as rewards"),
    "distill": Verb("kiln.pipeline_verbs", "distillation from a teacher checkpoint: generated data and soft targets"),
    "generate": Verb("kiln.infer.cli", "sample text from a checkpoint"),
    "export": Verb("kiln.hf", "export a checkpoint to another format"),
    "import": Verb("kiln.hf", "import a checkpoint from another format"),
    "launch": Verb(
        "kiln.pipeline_verbs", "pretrain under torchrun here, or write a Slurm script / Kubernetes manifest"
    ),
    "plan": Verb("kiln.pipeline_verbs", "estimate memory, step time, MFU and cost of parallel layouts on a cluster"),
    "report": Verb("kiln.report", "HTML report of a run: loss curves, throughput, data funnel, samples"),
    "serve": Verb("kiln.serve.cli", "serve a checkpoint over an OpenAI-compatible API, with a chat page at /"),
    "chat": Verb("kiln.serve.cli", "chat with a checkpoint in the terminal (history kept, chat template)"),
    "eval": Verb("kiln.eval.cli", "evaluate a checkpoint: MMLU, GSM8K, HumanEval, Kiln's tasks, safety, perplexity"),
    "sweep": Verb("kiln.sweep", "hyperparameter search with Optuna, each trial a real training run"),
}


# The examples each verb's --help ends with: the commands a newcomer types first.
EXAMPLES: dict[str, str] = {
    "run": "kiln run tiny                      # the packaged CPU demo\n"
    "kiln run my.toml train.max_steps=100 --stages corpus,tokenizer,pack,pretrain",
    "recipes": "kiln recipes",
    "init": "kiln init tiny                     # writes ./tiny.toml\nkiln init data-demo recipes/        # writes recipes/data-demo.toml",
    "corpus": "kiln corpus tiny",
    "data": "kiln data data-demo                # curation only; prints the funnel",
    "classifier": "kiln classifier train --positive good/ --negative raw/ --out quality.safetensors",
    "tokenizer": "kiln tokenizer train tiny tokenizer.vocab_size=4096",
    "pack": "kiln pack tiny pack.val_fraction=0.05",
    "pretrain": "kiln pretrain tiny train.max_steps=30\nkiln pretrain tiny --resume none",
    "sft": "kiln sft tiny",
    "judge": "kiln judge judge.toml",
    "rm": "kiln rm tiny                       # reward model on preference pairs",
    "dpo": "kiln dpo tiny dpo.beta=0.1",
    "ppo": "kiln ppo tiny",
    "grpo": "kiln grpo tiny",
    "distill": "kiln distill tiny",
    "generate": 'kiln generate runs/tiny/pretrain --prompt "def main("',
    "export": "kiln export hf runs/tiny/sft hf-model/",
    "import": "kiln import hf path/to/hf-model/ runs/imported/",
    "launch": "kiln launch local --nproc 2 tiny\nkiln launch slurm --nodes 4 my.toml --out job.sbatch",
    "plan": "kiln plan my.toml --gpu h100 --gpus-per-node 8 --nodes 8",
    "report": "kiln report runs/tiny",
    "serve": "kiln serve runs/tiny/sft --port 8000",
    "chat": "kiln chat runs/tiny/sft",
    "eval": "kiln eval runs/tiny/sft --tasks kiln_tasks,safety",
    "sweep": "kiln sweep tiny train.max_steps=100 --param train.lr=loguniform:1e-4:1e-2 --trials 8",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in --help (unless its help already says it, or it is a plain flag), and
    the examples epilog kept as written."""

    @staticmethod
    def _has_default(action: argparse.Action) -> bool:
        # `is`, not `in`: a default of 0 equals False and is still worth showing
        return not any(action.default is v for v in (None, False, argparse.SUPPRESS)) and action.default != []

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not self._has_default(action):
            return text
        return super()._get_help_string(action)

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and self._has_default(action):  # argparse prints nothing for no help
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose --help uses HelpFormatter; add_subparsers passes the class on, so every
    verb and sub-verb parser is one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def verb_module(verb: str) -> ModuleType:
    """The module implementing `verb`. The CLI's only import of a verb module, by name from the table,
    so that a command imports its own verb's module alone: `kiln --help` loads none (and no torch)."""
    return importlib.import_module(VERBS[verb].module)


def build_parser(loaded: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The `kiln` parser: the modules of the `loaded` verbs (default: all) register their verbs with
    their arguments; every other verb is listed from the table, with its help and no arguments."""
    parser = Parser(
        prog="kiln",
        description="Train language models end to end.",
        epilog="examples:\n  kiln recipes\n  kiln run tiny\n  kiln VERB --help",
    )
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    subparsers = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    modules = {VERBS[verb].module for verb in (VERBS if loaded is None else loaded)}
    for name, verb in VERBS.items():
        if verb.module not in modules:
            subparsers.add_parser(name, help=verb.help)
        elif name not in subparsers.choices:  # a module registers all of its verbs at once
            verb_module(name).add_parser(subparsers)
    for name, sub in subparsers.choices.items():
        sub.epilog = "examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[name].splitlines())
    return parser


def unknown_verb(argv: list[str]) -> str | None:
    """The error line for argv's first word when it is no verb (with the closest verb), else None."""
    for arg in argv:
        if not arg.startswith("-"):
            if arg in VERBS:
                return None
            return f"unknown verb {arg!r}{did_you_mean(arg, VERBS)} (kiln --help lists them)"
        if arg in ("-h", "--help", "--version") or "--help".startswith(arg) and arg.startswith("--h"):
            return None
    return None


def chosen_verb(argv: list[str]) -> str | None:
    """The verb argv names (its first word that is not an option), or None when there is none, when it
    is not in the table or when -h/--help comes before it: then the table alone answers."""
    for arg in argv:
        if arg.startswith("-h") or (arg.startswith("--h") and "--help".startswith(arg)):
            return None
        if not arg.startswith("-"):
            return arg if arg in VERBS else None
    return None


# The exit status of a command the file system stopped (disk full, read-only, permission denied):
# neither a bad input (2) nor a traceback or a diverged run (1).
OS_ERROR_EXIT = 3


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    unknown = unknown_verb(argv)
    if unknown:
        print(f"kiln: error: {unknown}", file=sys.stderr)
        return 2
    verb = chosen_verb(argv)
    args = build_parser([verb] if verb else []).parse_args(argv)
    try:
        return verb_module(args.verb).run(args)
    except (ConfigError, DataError) as err:
        print(f"kiln: error: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:  # a path the command was given (or its inputs name) is missing
        print(f"kiln: error: {os_error_line(err)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Output piped into a command that stopped reading (`kiln recipes | head -3`): not an error
        # worth a line; stdout goes to devnull so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as err:  # disk full, read-only, permission: the file system refused a write or read
        print(f"kiln: error: {os_error_line(err)}", file=sys.stderr)
        return OS_ERROR_EXIT
    except TrainingDiverged as err:
        print(f"kiln: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # `python -m kiln.cli`, as torchrun starts each rank of `kiln launch`
    sys.exit(main())
