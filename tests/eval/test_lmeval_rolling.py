"""Rolling perplexity of documents longer than the model's context, scored by lm-eval through its `hf`
model on the HF export and through its `local-completions` model against `kiln serve`.

lm-eval 0.4.13's API models keep `max_length - 1` as their own length (one token is generated), cut
rolling windows one shorter again (`max_length - 2` tokens) and send each as a prompt of up to
`max_length - 1` tokens with max_tokens=1; its `hf` model cuts windows of `max_length` tokens. The
server takes a prompt of at most context - 1 tokens when one token is to be generated. So the routes
agree with max_length=C for the server and C - 2 for hf, C the context (docs/eval.md)."""

import argparse
import shutil
from pathlib import Path

import pytest
import torch
from kiln_testing.lm_eval_tasks import write_lm_eval_tasks
from kiln_testing.serving import serving

from kiln.checkpoint import save_weights
from kiln.model import ModelConfig, build_model

CONTEXT = 64
KEY = "sk-rolling"


@pytest.mark.slow
def test_rolling_perplexity_of_long_documents_agrees_through_hf_and_the_server(tmp_path, monkeypatch, kiln_tokenizer):
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")
    from lm_eval.tasks import TaskManager

    from kiln.hf import export_checkpoint_to_hf
    from kiln.serve.app import create_app
    from kiln.serve.cli import load_for_inference

    tok = kiln_tokenizer
    torch.manual_seed(5)
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=2, max_seq_len=CONTEXT, init_std=0.1)
    ckpt = save_weights(tmp_path / "ckpt", cfg, build_model(cfg).state_dict(), {"step": 1})
    shutil.copy(tok.path, Path(ckpt) / "tokenizer.json")
    export_checkpoint_to_hf(ckpt, tok.path, tmp_path / "hf", chat=False)
    texts = [
        "def add(a, b):\n    return a + b\n\n" * 20,
        "The quick brown fox jumps over the lazy dog. " * 20,
    ]
    assert min(len(tok.encode(t)) for t in texts) > 3 * CONTEXT  # several windows each
    tasks = [name for name in write_lm_eval_tasks(tmp_path / "data", "roll", [(1, 2)], texts)[0] if "ppl" in name]
    common = dict(
        tasks=tasks, num_fewshot=0, log_samples=True, task_manager=TaskManager(include_path=str(tmp_path / "data"))
    )

    def hf(max_length: int) -> list[float]:
        args = f"pretrained={tmp_path / 'hf'},dtype=float32,max_length={max_length}"
        out = lm_eval.simple_evaluate(model="hf", model_args=args, batch_size=2, device="cpu", **common)
        return _doc_lls(out)

    window = CONTEXT - 2
    by_hf, by_hf_full = hf(window), hf(CONTEXT)
    model, served_tok = load_for_inference(
        argparse.Namespace(checkpoint=str(ckpt), tokenizer=None, device="cpu", dtype="auto")
    )
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with serving(create_app(model, served_tok, model_name="m", api_keys=[KEY])) as (base, _):
        args = (
            f"model=m,base_url={base}/v1/completions,auth_token={KEY},max_length={window + 2},"
            "batch_size=2,num_concurrent=1,max_retries=1,tokenized_requests=True"
        )
        by_server = _doc_lls(lm_eval.simple_evaluate(model="local-completions", model_args=args, **common))
    assert by_server == pytest.approx(by_hf, abs=1e-3)
    # hf's default max_length (the context) cuts other windows: a different, equally valid score.
    gaps = [abs(a - b) / abs(b) for a, b in zip(by_hf_full, by_hf)]
    assert max(gaps) > 1e-4
    print(
        f"\nlong-document log-likelihoods: hf max_length={window} {by_hf}, server max_length={window + 2} {by_server}"
    )
    print(f"hf max_length={CONTEXT}: {by_hf_full} (relative gaps {['%.4f' % g for g in gaps]})")


def _doc_lls(out: dict) -> list[float]:
    samples = sorted(out["samples"][next(iter(out["samples"]))], key=lambda s: s["doc_id"])
    return [float(s["resps"][0][0]) for s in samples]
