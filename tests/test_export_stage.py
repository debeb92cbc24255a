"""The export stage: `kiln run` writes the run's model as a transformers folder into <run>/export/,
refuses by name when there is nothing to export, and (slow) the chat recipe shrunk end to end, served
by the command its `next:` line prints and answering the official `openai` client."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kiln_testing.recipes import mini_overrides
from kiln_testing.serving import free_port, wait_until_healthy

from kiln import cli
from kiln.data.chat import render_prompt
from kiln.data.tokenizer import Tokenizer
from kiln.errors import ConfigError
from kiln.peft.load import load_model
from kiln.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]


def _post_overrides(tmp_path: Path, name: str, stages: list[str]) -> list[str]:
    """A mini run of `stages` (SFT and GRPO a few steps each) into tmp_path."""
    return [
        *mini_overrides(max_steps=6, every=6),
        f'run.out_dir="{tmp_path}"',
        f'run.name="{name}"',
        "run.stages=[" + ",".join(f'"{s}"' for s in stages) + "]",
        "train.compile=false",
        'tasks.families=["reverse"]',
        "tasks.train_per_family=64",
        "tasks.heldout_per_family=4",
        "sft.train.max_steps=2",
        "sft.train.warmup_steps=0",
        "sft.train.eval_every=2",
        "sft.train.ckpt_every=2",
        "sft.train.micro_batch_size=4",
        "grpo.train.max_steps=1",
        "grpo.train.warmup_steps=0",
        "grpo.train.eval_every=1",
        "grpo.train.ckpt_every=1",
    ]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A mini run (corpus -> pretrain -> two SFT steps -> export) and what `kiln run` printed."""
    root = tmp_path_factory.mktemp("export")
    overrides = _post_overrides(root, "run", ["corpus", "tokenizer", "pack", "pretrain", "sft", "export"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["run", "tiny", *overrides]) == 0
    return root, out.getvalue()


def test_export_stage_writes_a_folder_transformers_loads(sft_run):
    transformers = pytest.importorskip("transformers")
    root, printed = sft_run
    export = root / "run" / "export"
    assert (export / "DONE").is_file()
    stats = json.loads((export / "DONE").read_text())["stats"]
    assert stats["source"] == "sft" and stats["chat"] is True
    # The summary names what was exported, and the next line serves the checkpoint it came from.
    assert "[export] sft chat model" in printed
    next_line = [line for line in printed.splitlines() if line.startswith("next: ")][-1]
    assert next_line.startswith(f"next: kiln serve {stats['checkpoint']}")
    assert str(export) in next_line

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    kiln_model, _ = load_model(stats["checkpoint"])
    ids = torch.tensor([[1, 5, 9, 33, 100, 7, 2, 64]])
    with torch.no_grad():
        expected = kiln_model(ids).float()
        got = hf_model(ids).logits.float()
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()

    # The tokenizer and the chat template travelled with the export: the same ids as Kiln's.
    tok = transformers.AutoTokenizer.from_pretrained(export)
    kiln_tok = Tokenizer.load(root / "run" / "tokenizer")
    text = "def reverse(items):\n    return items[::-1]\n"
    assert tok(text, add_special_tokens=False)["input_ids"] == kiln_tok.encode(text)
    messages = [{"role": "user", "content": "reverse 1 2 3"}]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert chat["input_ids"] == render_prompt(kiln_tok, messages)
    config = json.loads((export / "config.json").read_text())
    assert isinstance(config["eos_token_id"], list)  # a chat model stops at the end of its turn


def test_export_dtype_key_casts_the_weights_and_reruns_only_export(sft_run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    root, _ = sft_run
    shutil.copytree(root / "run", tmp_path / "run")
    overrides = _post_overrides(tmp_path, "run", ["corpus", "tokenizer", "pack", "pretrain", "sft", "export"])
    assert cli.main(["run", "tiny", *overrides, 'export.dtype="bfloat16"']) == 0
    printed = capsys.readouterr().out
    assert "[sft] done already" in printed
    assert "[export] inputs changed (export.dtype: 'checkpoint' -> 'bfloat16'); rebuilding" in printed
    export = tmp_path / "run" / "export"
    assert json.loads((export / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(export, torch_dtype="auto")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_export_with_nothing_to_export_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(ConfigError) as err:
        load_recipe(None, [f'run.out_dir="{tmp_path}"', 'run.stages=["corpus","tokenizer","export"]'])
    assert err.value.key == "run.stages" and "nothing to export" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_recipe(None, [f'run.out_dir="{tmp_path}"', 'run.stages=["pretrain","export"]', 'export.source="sft"'])
    assert err.value.key == "export.source"
    with pytest.raises(ConfigError) as err:
        load_recipe(None, ['export.dtype="int8"'])
    assert err.value.key == "export.dtype"
    # The stage whose model is missing is named, in one line, before anything is written.
    stages = 'run.stages=["pretrain","sft","export"]'
    assert cli.main(["run", "tiny", f'run.out_dir="{tmp_path}"', stages, "--stages", "export"]) == 2
    captured = capsys.readouterr()
    error = captured.err.strip().splitlines()
    assert len(error) == 1 and "the sft stage has no finished model" in error[0], captured.err
    assert "--stages sft" in error[0]
    assert not (tmp_path / "tiny" / "export" / "DONE").exists()


def test_a_stage_before_export_names_how_to_run_it(tmp_path, capsys):
    from kiln.stage_summary import next_command

    line = next_command("sft", ["pretrain", "sft", "export"], "chat", tmp_path / "sft")
    assert line == "next: kiln run chat --stages export"


@pytest.mark.slow
def test_chat_recipe_shrunk_end_to_end_then_served(tmp_path):
    """`kiln run chat` (curation included) on a shrunk budget, then the `kiln serve` command its
    next line prints, answering one chat request from the official openai client."""
    openai = pytest.importorskip("openai")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    overrides = [
        *_post_overrides(tmp_path, "chat", []),
        "corpus.max_bytes_per_source=150000",
        "data.tasks=1",
        "data.workers=1",
    ]
    overrides = [o for o in overrides if not o.startswith("run.stages=")]  # the recipe's own stages
    run = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "run", "chat", *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for stage in load_recipe(REPO / "recipes" / "chat.toml").run.stages:  # GRPO is not among them
        assert (tmp_path / "chat" / stage / "DONE").is_file(), stage
    assert (tmp_path / "chat" / "export" / "config.json").is_file()
    next_line = [line for line in run.stdout.splitlines() if line.startswith("next: kiln serve ")][-1]
    serve_args = shlex.split(next_line.removeprefix("next: ").split("   (")[0])
    assert serve_args[:2] == ["kiln", "serve"]
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", *serve_args[1:], "--port", str(port), "--served-model-name", "chat"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(base, 120, server)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "Reverse the list: 3 1 2"}], max_tokens=16
        )
        assert reply.choices[0].message.role == "assistant"
        assert isinstance(reply.choices[0].message.content, str)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens >= 1
    finally:
        server.terminate()
        server.wait(30)
