"""lm-evaluation-harness scores a Kiln model the same way through both routes: lm_eval's `hf` model on
the Hugging Face export, and its `local-completions` model against `kiln serve`'s /v1/completions
(echo + logprobs for log-likelihoods, stop strings for generation, the server's /tokenize for
tokenization)."""

import argparse
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from kiln_testing.lm_eval_tasks import write_lm_eval_tasks
from kiln_testing.models import ForcesToken
from kiln_testing.serving import serving

from kiln.checkpoint import save_weights
from kiln.model import ModelConfig, build_model

KEY = "sk-lmeval"
NAME = "tiny"
MAX_SEQ_LEN = 128


def _write_tasks(data: Path) -> list[str]:
    """Three custom lm-eval tasks over local JSONL (no network): multiple choice with acc and
    acc_norm, rolling perplexity, and greedy generation until a stop string."""
    pairs = [(2, 3), (7, 1), (4, 4), (9, 2), (3, 8), (6, 5), (1, 1), (5, 7), (8, 6), (2, 9)]
    texts = [
        "def add(a, b):\n    return a + b\n",
        "The quick brown fox jumps over the lazy dog. " * 2,
        "import os\nprint(os.getcwd())\n",
    ]
    return write_lm_eval_tasks(data, "srv", pairs, texts)[0]


def test_special_tokens_are_left_out_of_generated_text_unless_asked(kiln_tokenizer):
    """vLLM's skip_special_tokens (default true), which lm-eval's HF backend matches by decoding with
    skip_special_tokens=True: a generated <|user|> is counted and has a logprob, but is not text."""
    from fastapi.testclient import TestClient

    from kiln.serve.app import create_app

    tok = kiln_tokenizer
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=2, max_seq_len=64)
    user = tok.token_id("<|user|>")
    prompt = tok.encode("import os")
    model = ForcesToken(build_model(cfg).eval(), user, len(prompt) + 3, onward=False)
    with TestClient(create_app(model, tok, model_name="m")) as client:

        def complete(**extra):
            body = {
                "model": "m",
                "prompt": prompt,
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
                **extra,
            }
            return client.post("/v1/completions", json=body).json()

        plain, raw = complete(), complete(skip_special_tokens=False)
    assert raw["choices"][0]["logprobs"]["tokens"][3] == "<|user|>"
    assert "<|user|>" in raw["choices"][0]["text"] and "<|user|>" not in plain["choices"][0]["text"]
    assert plain["choices"][0]["text"] == raw["choices"][0]["text"].replace("<|user|>", "")
    assert plain["choices"][0]["logprobs"]["tokens"] == raw["choices"][0]["logprobs"]["tokens"]
    assert plain["usage"] == raw["usage"] and plain["usage"]["completion_tokens"] == 6


def _by_doc(samples: list[dict]) -> list[dict]:
    return sorted(samples, key=lambda s: s["doc_id"])


@pytest.mark.slow
def test_lm_eval_scores_the_same_through_the_hf_export_and_the_server(tmp_path, monkeypatch, kiln_tokenizer):
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")  # lm-eval's API models need it (lm_eval[api])
    from lm_eval.tasks import TaskManager

    from kiln.hf import export_checkpoint_to_hf
    from kiln.serve.app import create_app
    from kiln.serve.cli import load_for_inference

    tok = kiln_tokenizer
    torch.manual_seed(3)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=MAX_SEQ_LEN, init_std=0.1
    )
    ckpt = save_weights(tmp_path / "ckpt", cfg, build_model(cfg).state_dict(), {"step": 1})
    shutil.copy(tok.path, Path(ckpt) / "tokenizer.json")
    export_checkpoint_to_hf(ckpt, tok.path, tmp_path / "hf", chat=False)
    tasks = _write_tasks(tmp_path / "data")
    manager = TaskManager(include_path=str(tmp_path / "data"))
    common = dict(tasks=tasks, num_fewshot=0, log_samples=True, task_manager=manager)

    hf = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={tmp_path / 'hf'},dtype=float32", batch_size=4, device="cpu", **common
    )

    # What `kiln serve CKPT --api-key KEY` loads and runs (fp32 on CPU).
    model, served_tok = load_for_inference(
        argparse.Namespace(checkpoint=str(ckpt), tokenizer=None, device="cpu", dtype="auto")
    )
    from lm_eval.utils import RemoteTokenizer

    remote_calls = []
    encode = RemoteTokenizer.encode
    monkeypatch.setattr(RemoteTokenizer, "encode", lambda self, text: remote_calls.append(text) or encode(self, text))
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # local-completions sends it as the Bearer token
    served = {}
    with serving(create_app(model, served_tok, model_name=NAME, api_keys=[KEY])) as (server_base, _):
        # max_length is the model's context (lm-eval's default of 2048 would send inputs the server refuses).
        base = (
            f"model={NAME},base_url={server_base}/v1/completions,auth_token={KEY},max_length={MAX_SEQ_LEN},"
            "batch_size=4,num_concurrent=2,max_retries=1,tokenized_requests=True"
        )
        # tokenizer_backend auto: lm-eval finds /tokenizer_info and /tokenize and tokenizes through the
        # server, so the client needs no copy of the tokenizer; or it reads the HF export's tokenizer.
        hf_tokenizer = f",tokenizer_backend=huggingface,tokenizer={tmp_path / 'hf'}"
        for backend, extra in (("remote", ""), ("huggingface", hf_tokenizer)):
            served[backend] = lm_eval.simple_evaluate(model="local-completions", model_args=base + extra, **common)
            assert bool(remote_calls) == (backend == "remote")
            remote_calls.clear()
        assert httpx.get(server_base + "/health").json()["status"] == "ok"
    for backend, out in served.items():
        worst = _assert_same_scores(out, hf)
        ours, theirs = out["results"], hf["results"]
        print(
            f"\nlm-eval, hf vs local-completions ({backend} tokenizer): "
            f"srv_mc acc {theirs['srv_mc']['acc,none']:.4f} / {ours['srv_mc']['acc,none']:.4f}, "
            f"acc_norm {theirs['srv_mc']['acc_norm,none']:.4f} / {ours['srv_mc']['acc_norm,none']:.4f}; "
            f"srv_ppl word_perplexity {theirs['srv_ppl']['word_perplexity,none']:.6g} / "
            f"{ours['srv_ppl']['word_perplexity,none']:.6g}; "
            f"srv_gen exact_match {theirs['srv_gen']['exact_match,none']} / {ours['srv_gen']['exact_match,none']}; "
            f"largest per-choice log-likelihood gap {worst:.2e}"
        )


def _assert_same_scores(served: dict, hf: dict) -> float:
    """Every metric equal (perplexities to fp tolerance), per-choice log-likelihoods within 1e-4 and
    the same greedy flags, the same generated texts; returns the largest log-likelihood gap."""
    ours, theirs = served["results"], hf["results"]
    for metric in ("acc", "acc_norm"):
        assert ours["srv_mc"][f"{metric},none"] == theirs["srv_mc"][f"{metric},none"]
        assert ours["srv_mc"][f"{metric}_stderr,none"] == pytest.approx(theirs["srv_mc"][f"{metric}_stderr,none"])
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert ours["srv_ppl"][f"{metric},none"] == pytest.approx(theirs["srv_ppl"][f"{metric},none"], rel=1e-5)
    assert ours["srv_gen"]["exact_match,none"] == theirs["srv_gen"]["exact_match,none"]

    served_mc, hf_mc = _by_doc(served["samples"]["srv_mc"]), _by_doc(hf["samples"]["srv_mc"])
    assert [s["arguments"] for s in served_mc] == [s["arguments"] for s in hf_mc]
    worst = 0.0
    for a, b in zip(served_mc, hf_mc):
        lls_served = [float(r[0][0]) for r in a["resps"]]
        lls_hf = [float(r[0][0]) for r in b["resps"]]
        assert lls_served == pytest.approx(lls_hf, abs=1e-4)
        worst = max(worst, *(abs(x - y) for x, y in zip(lls_served, lls_hf)))
        assert [bool(r[0][1]) for r in a["resps"]] == [bool(r[0][1]) for r in b["resps"]]
    served_ppl, hf_ppl = _by_doc(served["samples"]["srv_ppl"]), _by_doc(hf["samples"]["srv_ppl"])
    assert [float(s["resps"][0][0]) for s in served_ppl] == pytest.approx(
        [float(s["resps"][0][0]) for s in hf_ppl], abs=1e-3
    )
    # The generations hold special tokens (<|system|>, ...): the server leaves them out of the text,
    # as transformers' decode in lm-eval's HF backend does.
    served_gen, hf_gen = _by_doc(served["samples"]["srv_gen"]), _by_doc(hf["samples"]["srv_gen"])
    assert [s["resps"][0][0] for s in served_gen] == [s["resps"][0][0] for s in hf_gen]
    return worst
