"""Every folder a PEFT stage leaves loads in every tool: a short `sft` with LoRA, QLoRA and bottleneck
adapters, then its stage folder through `kiln export hf` (logits checked against transformers),
`kiln generate`, `kiln eval`, the model `kiln serve` loads, and a `dpo` stage started from it."""

import dataclasses
import json
import os

import pytest
import torch

from kiln.checkpoint import CheckpointError, save_weights
from kiln.cli import main
from kiln.errors import ConfigError
from kiln.infer.load import load_for_inference
from kiln.model import ModelConfig, build_model
from kiln.peft import PeftConfig, adapter_modules, load_model, load_trainable, plain_weights
from kiln.post.config import DPOConfig, SFTConfig, StageTrainConfig, TaskConfig
from kiln.post.driver import run_stage
from kiln.recipe import Recipe

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
SHORT = StageTrainConfig(
    lr=1e-2, max_steps=2, warmup_steps=0, seq_len=48, micro_batch_size=4, eval_every=2, eval_batches=1, ckpt_every=2
)
METHODS = ["lora", "qlora", "adapter"]


def recipe(method: str, **peft) -> Recipe:
    r = Recipe()
    r.train = dataclasses.replace(r.train, precision="fp32", peak_flops=1e12, log_every=1, compile=False)
    r.tasks = TaskConfig(families=["sort"], train_per_family=24, heldout_per_family=2)
    r.sft, r.dpo = SFTConfig(train=SHORT), DPOConfig(train=SHORT)
    # All five linears, the head included, so the merge covers every kind of LoRA layer.
    targets = ["attn.wqkv", "attn.wo", "ffn.w1", "ffn.w3", "ffn.w2", "output"]
    r.peft = PeftConfig(method=method, r=4, targets=targets, adapter_hidden=8, lora_dtype="float32", **peft)
    return r


@pytest.fixture(scope="module", params=METHODS)
def sft_run(request, tok, tmp_path_factory):
    """(method, folder holding init/ and the sft/ stage trained on it)."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp(f"peft_{request.param}")
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    save_weights(root / "init", cfg, build_model(cfg).state_dict())
    run_stage("sft", recipe(request.param), root / "sft", root / "init", tok, resume="none")
    return request.param, root


def logits(model, tok):
    ids = torch.tensor([tok.encode("sort: 3 1 2 ->")])
    with torch.no_grad():
        return model(ids)


def test_the_stage_folder_loads_as_the_trained_model(sft_run, tok):
    method, root = sft_run
    model, manifest = load_model(root / "sft")
    init, _ = load_model(root / "init")
    assert manifest["step"] == 2
    assert (logits(model, tok) - logits(init, tok)).abs().max() > 1e-3  # training changed the model
    if method == "adapter":
        # No plain-weights form; the adapters stay and equal the stage's adapter/ export on the base.
        assert not (root / "sft" / "merged").exists()
        assert len(adapter_modules(model)) == 2 * model.cfg.n_layers
        expected = init
        load_trainable(expected, root / "sft" / "adapter")
    else:
        # LoRA folded into plain weights: the model `merged/` holds, parameter for parameter.
        assert not adapter_modules(model)
        expected, _ = load_model(root / "sft" / "merged")
        assert model.state_dict().keys() == expected.state_dict().keys()
    torch.testing.assert_close(logits(model, tok), logits(expected.eval(), tok), rtol=1e-5, atol=1e-5)


def test_export_hf_of_the_stage_folder(sft_run, tok, tmp_path, capsys):
    method, root = sft_run
    args = ["export", "hf", str(root / "sft"), str(tmp_path / "hf"), "--tokenizer", str(tok.path)]
    if method == "adapter":  # a Llama model has no place for them: refused as one line, nothing written
        assert main(args) != 0
        assert 'has bottleneck adapters (peft.method = "adapter"), which cannot be merged' in capsys.readouterr().err
        assert not (tmp_path / "hf").exists()
        with pytest.raises(CheckpointError, match="cannot be merged"):
            plain_weights(root / "sft", adapters=False)
        return
    transformers = pytest.importorskip("transformers")
    assert main(args) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor([tok.encode("sort: 3 1 2 ->")])
    with torch.no_grad():
        theirs = hf(ids).logits
    # merged/ was written from the live model at the end of the stage, by another path than the loader.
    torch.testing.assert_close(theirs, logits(load_model(root / "sft" / "merged")[0], tok), rtol=1e-4, atol=1e-4)


def test_generate_and_eval_run_on_the_stage_folder(sft_run, tok, tmp_path, capsys):
    method, root = sft_run
    assert main(["generate", str(root / "sft"), "--tokenizer", str(tok.path), "--prompt", "sort: 2 1 ->"]) == 0
    assert "sort: 2 1 ->" in capsys.readouterr().out
    text = tmp_path / "text.txt"
    text.write_text("sort: 3 1 2 -> 1 2 3\n" * 8)

    def perplexity(folder) -> float:
        args = ["eval", str(folder), "--tasks", "perplexity", "--text", str(text), "--tokenizer", str(tok.path)]
        assert main([*args, "--out", str(tmp_path), "--name", folder.name]) == 0
        return json.loads((tmp_path / "eval" / f"{folder.name}.json").read_text())["scores"][
            "perplexity/token_perplexity"
        ]

    # The same model as merged/ (LoRA), or one the adapters changed from the starting weights.
    ours, other = perplexity(root / "sft"), perplexity(root / ("init" if method == "adapter" else "sft/merged"))
    assert ours != other if method == "adapter" else ours == pytest.approx(other, rel=1e-5)


def test_serve_loads_the_stage_folder(sft_run, tok):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from kiln.serve.app import create_app

    _, root = sft_run
    model, tokenizer = load_for_inference(root / "sft", tok.path)
    with TestClient(create_app(model, tokenizer, model_name="m")) as client:
        body = {"model": "m", "prompt": "sort: 2 1 ->", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


def test_dpo_starts_from_the_stage_folder(sft_run, tok):
    method, root = sft_run
    out = root / "dpo"
    stats = run_stage("dpo", recipe(method), out, root / "sft", tok, resume="none")
    assert stats["train"]["steps"] == 2
    sft_model, _ = load_model(root / "sft")
    dpo_model, _ = load_model(out)
    # The reference DPO starts from is the SFT policy, so held-out accuracy before DPO is SFT's after.
    sft_stats = json.loads((root / "sft" / "stats.json").read_text())
    assert stats["heldout_before"] == sft_stats["heldout_after"]
    assert (logits(dpo_model, tok) - logits(sft_model, tok)).abs().max() > 0
    if method == "adapter":  # DPO continued the SFT adapters (same width) rather than stacking new ones
        assert len(adapter_modules(dpo_model)) == 2 * dpo_model.cfg.n_layers


def test_a_stage_that_cannot_continue_an_adapter_checkpoint_is_refused(sft_run, tok, tmp_path):
    method, root = sft_run
    if method != "adapter":
        pytest.skip("only adapter checkpoints constrain the next stage's [peft]")
    with pytest.raises(ConfigError, match="peft.method: is 'lora', but the model starts from a checkpoint with"):
        run_stage("dpo", recipe("lora"), tmp_path / "dpo", root / "sft", tok, resume="none")
    with pytest.raises(ConfigError, match="peft.adapter_hidden: is 16, but the model already has adapters of width 8"):
        run_stage(
            "dpo",
            dataclasses.replace(recipe("adapter"), peft=PeftConfig(method="adapter", adapter_hidden=16)),
            tmp_path / "dpo2",
            root / "sft",
            tok,
            resume="none",
        )


def test_checkpoints_the_loader_cannot_rebuild_are_one_line_errors(tok, tmp_path):
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=4, max_seq_len=64)
    state = build_model(cfg).state_dict()
    save_weights(tmp_path / "critic", cfg, {**state, "critic.weight": torch.zeros(1, 32)})
    with pytest.raises(CheckpointError, match=r"critic: the weights do not fit a Transformer .*critic\.weight"):
        load_model(tmp_path / "critic")
    lora = {k.replace("attn.wo.weight", "attn.wo.base.weight"): v for k, v in state.items()}
    save_weights(tmp_path / "lora", cfg, {**lora, "layers.0.attn.wo.lora_A": torch.zeros(4, 32)})
    with pytest.raises(CheckpointError, match="holds LoRA/NF4 weights but its manifest has no recipe"):
        load_model(tmp_path / "lora")
