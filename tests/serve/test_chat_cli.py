"""`kiln chat`'s commands, driven with a scripted stdin: none of them reaches the model."""

import argparse
import io
import shutil

import pytest
from kiln_testing.serving import tiny_checkpoint

from kiln.data.chat import ChatTokens, render_prompt
from kiln.infer.engine import Engine
from kiln.recipe import POST_STAGES
from kiln.serve.cli import CHAT_STAGES, HELP, add_parser, chat_trained, load_for_inference, run_chat


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("chatcli")
    tiny_checkpoint(root, root / "run" / "sft" / "ckpt")
    shutil.copytree(root / "run" / "sft" / "ckpt", root / "base")
    return root


def _chat(folder, lines):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="verb"))
    args = parser.parse_args(["chat", str(folder), "--temperature", "0", "--max-new-tokens", "8", "--device", "cpu"])
    out, err = io.StringIO(), io.StringIO()
    assert run_chat(args, stdin=io.StringIO("".join(line + "\n" for line in lines)), stdout=out, stderr=err) == 0
    return out.getvalue(), err.getvalue()


def _reply(folder, history):
    model, tok = load_for_inference(argparse.Namespace(checkpoint=str(folder), tokenizer=None, device="cpu"))
    engine = Engine(model, tok)
    return engine.generate([render_prompt(tok, history)], 8, temperature=0, stop_token_ids=ChatTokens(tok).stop)[0].text


def test_chat_commands(checkpoint):
    folder = checkpoint / "run" / "sft" / "ckpt"
    out, err = _chat(folder, ["/help", "Hi", "/reset", "/system Be brief.", "Hi", "/bogus", "//x", "/quit", "never"])
    assert HELP in err  # /help is answered, not sent: only three replies reach stdout
    assert "(conversation cleared)" in err and "(system message set; conversation cleared)" in err
    assert "unknown command /bogus" in err
    hi = _reply(folder, [{"role": "user", "content": "Hi"}])
    brief = _reply(folder, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    slash = _reply(
        folder,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": brief},
            {"role": "user", "content": "/x"},
        ],
    )
    assert out == f"{hi}\n{brief}\n{slash}\n"  # /reset dropped the first exchange; /quit stopped before "never"
    assert "no chat training" not in err


def test_chat_trained_from_stage_folder(checkpoint):
    assert set(CHAT_STAGES) == set(POST_STAGES) - {"rm"}
    assert chat_trained(checkpoint / "run" / "sft" / "ckpt")
    assert not chat_trained(checkpoint / "base")
    _, err = _chat(checkpoint / "base", [])
    assert "no chat training" in err
