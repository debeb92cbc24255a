"""The `kiln` command end to end on a miniature run: every verb of the spine, through the CLI."""

import argparse
import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kiln_testing.recipes import mini_overrides

from kiln.cli import VERBS, main

ROOT = Path(__file__).resolve().parents[1]

MINI = [
    *mini_overrides(max_steps=12, warmup_steps=2, every=6),
    "train.log_every=2",
    "sample.max_new_tokens=8",
    "sample.num_samples=1",
    # recipes/tiny.toml also runs the post-training stages; this miniature run checks the spine only.
    'run.stages=["corpus","tokenizer","pack","pretrain","sample"]',
]


def test_bad_override_is_one_line_error(capsys):
    assert main(["pretrain", "recipes/tiny.toml", "model.n_heads=5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "kiln: error: recipes/tiny.toml: model.n_heads: must divide dim=256, got 5"


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "kiln.cli", "--help"], capture_output=True, text=True, check=True)
    for verb in ("run", "tokenizer", "pack", "pretrain", "generate", "export", "import"):
        assert verb in out.stdout


def test_kiln_help_lists_every_verb_of_the_table_with_its_help():
    env = {**os.environ, "COLUMNS": "400"}  # one line per verb
    out = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "--help"], capture_output=True, text=True, check=True, env=env
    ).stdout
    listed = dict(re.findall(r"^    (\S+)\s+(.+)$", out, re.M))
    assert listed == {name: verb.help for name, verb in VERBS.items()}
    assert all(verb.help.strip() for verb in VERBS.values())


@pytest.mark.parametrize("module", sorted({verb.module for verb in VERBS.values()}))
def test_each_verb_module_registers_exactly_its_table_verbs(module):
    """A module's add_parser registers the verbs the table gives it, with the table's help, and it has
    a run; a verb the module registers but the table lacks fails here."""
    mod = importlib.import_module(module)
    assert callable(mod.add_parser) and callable(mod.run)
    subparsers = argparse.ArgumentParser().add_subparsers(dest="verb")
    mod.add_parser(subparsers)
    registered = {action.dest: action.help for action in subparsers._choices_actions}
    assert registered == {name: verb.help for name, verb in VERBS.items() if verb.module == module}


def test_every_verb_module_is_in_the_table():
    """Every module of kiln/ that defines add_parser and run at its top level is a verb module of the table."""
    found = set()
    for path in (ROOT / "kiln").rglob("*.py"):
        names = {node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}
        if {"add_parser", "run"} <= names:
            found.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    assert found == {verb.module for verb in VERBS.values()}


def test_readme_verb_table_names_every_verb():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## The `kiln` command", 1)[1].split("\n\n", 2)[1]
    named = {v for group in re.findall(r"`kiln ([a-z|\\]+)", table) for v in group.split("\\|")}
    assert named == set(VERBS)


def test_help_imports_no_verb_module_and_no_torch():
    code = (
        "import sys\nfrom kiln.cli import VERBS, main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in {v.module for v in VERBS.values()} | {'torch'} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_run_generate_export_import(tmp_path, capsys):
    run = [f'run.out_dir="{tmp_path}"', "run.name=mini", *MINI]
    assert main(["run", "recipes/tiny.toml", *run]) == 0
    out = capsys.readouterr().out
    assert "val loss" in out and "run folder" in out
    run_dir = tmp_path / "mini"
    for stage in ("corpus", "tokenizer", "pack", "pretrain", "sample"):
        assert (run_dir / stage / "DONE").exists(), stage
    summary = json.loads((run_dir / "pretrain" / "summary.json").read_text())
    assert summary["steps"] == 12
    assert (run_dir / "sample" / "samples.txt").read_text().startswith("--- sample 0")

    # A second run skips every stage.
    assert main(["run", "recipes/tiny.toml", *run]) == 0
    assert capsys.readouterr().out.count("skipping") == 5

    assert (
        main(
            ["generate", str(run_dir / "pretrain"), "--prompt", "import", "--max-new-tokens", "5", "--temperature", "0"]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("import")

    hf_dir, back = tmp_path / "hf", tmp_path / "back"
    assert main(["export", "hf", str(run_dir / "pretrain"), str(hf_dir)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in hf_dir.iterdir()
    }
    assert main(["import", "hf", str(hf_dir), str(back)]) == 0
    assert (
        main(
            [
                "generate",
                str(back),
                "--tokenizer",
                str(hf_dir / "tokenizer.json"),
                "--prompt",
                "import",
                "--max-new-tokens",
                "5",
                "--temperature",
                "0",
            ]
        )
        == 0
    )


def test_data_verb_curates_explicit_inputs(tmp_path, capsys):
    docs = tmp_path / "raw.jsonl"
    prose = "The quick brown fox jumps over the lazy dog and then it rests in the warm sun. " * 8
    lines = [
        json.dumps({"id": f"d{i}", "text": prose + f"Contact me at user{i}@example.com.", "source": "web"})
        for i in range(3)
    ]
    docs.write_text("\n".join(lines + ["{broken"]) + "\n")
    args = [
        "data",
        "recipes/tiny.toml",
        f'run.out_dir="{tmp_path}"',
        "run.name=cur",
        f'data.inputs=["{docs}"]',
        'data.steps=["normalize", "exact_dedup", "pii"]',
        "data.tasks=1",
    ]
    assert main(args) == 0
    assert "exact_dedup" in capsys.readouterr().out  # the funnel
    out = tmp_path / "cur" / "data"
    kept = [json.loads(line) for line in (out / "docs" / "part-00000.jsonl").read_text().splitlines()]
    # The documents differ only in their addresses: exact dedup (before PII scrubbing) keeps all three.
    assert len(kept) == 3 and all("<EMAIL>" in d["text"] for d in kept)
    stats = json.loads((out / "stats.json").read_text())
    assert stats["steps"][0]["reasons"] == {"bad_json": 1}
    assert not (tmp_path / "cur" / "corpus").exists()  # explicit inputs need no corpus


def test_classifier_train_verb(tmp_path, capsys):
    good = "The interpreter reads each statement, compiles it and runs the code object it produced. "
    bad = "click here click here subscribe now buy cheap best price login menu home "
    for name, text in (("pos", good), ("neg", bad)):
        lines = [json.dumps({"id": f"{name}{i}", "text": (text * (2 + i % 3)) + f" item {i}"}) for i in range(40)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    model = tmp_path / "q.safetensors"
    assert (
        main(
            [
                "classifier",
                "train",
                "--positive",
                str(tmp_path / "pos.jsonl"),
                "--negative",
                str(tmp_path / "neg.jsonl"),
                "--out",
                str(model),
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["heldout_accuracy"] > 0.9
    assert model.exists() and model.with_suffix(".json").exists()


@pytest.mark.slow
def test_launch_local_trains_sharded_and_generates(tmp_path, capsys):
    """`kiln launch local --nproc 2`: rank 0 builds corpus, tokenizer and pack while rank 1 waits,
    both ranks pretrain under FSDP2, the sharded checkpoint serves `kiln generate`."""
    run = [f'run.out_dir="{tmp_path}"', "run.name=mini", *MINI, "parallel.dp_shard=2"]
    assert main(["launch", "local", "--nproc", "2", "recipes/tiny.toml", *run]) == 0
    run_dir = tmp_path / "mini"
    for stage in ("corpus", "tokenizer", "pack", "pretrain"):
        assert (run_dir / stage / "DONE").exists(), stage
    summary = json.loads((run_dir / "pretrain" / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["final_val_loss"] < summary["best_val_loss"] + 1e-9
    latest = (run_dir / "pretrain" / "checkpoints" / "latest").read_text().strip()
    assert (run_dir / "pretrain" / "checkpoints" / latest / "sharded" / ".metadata").is_file()
    capsys.readouterr()
    assert (
        main(
            ["generate", str(run_dir / "pretrain"), "--prompt", "import", "--max-new-tokens", "5", "--temperature", "0"]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("import")


def test_a_one_document_corpus_is_one_line_naming_the_minimum(tmp_path, capsys):
    """Before: a TypeError printing the tokenizer's held-out compression, which one document lacks."""
    docs = tmp_path / "one.jsonl"
    docs.write_text(json.dumps({"id": "a", "text": "The only document of the corpus. " * 10, "source": "web"}) + "\n")
    args = [
        "run",
        "recipes/tiny.toml",
        f'run.out_dir="{tmp_path}"',
        "run.name=one",
        'run.stages=["data", "tokenizer", "pack"]',
        f'data.inputs=["{docs}"]',
        'data.steps=["normalize"]',
        "data.tasks=1",
    ]
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "1 document in 1 source, too few to split: a corpus needs at least 2 documents of one "
        "source (one held out for validation, the rest to train on)"
    ), err
    assert len(err.splitlines()) == 1 and str(tmp_path / "one") in err
