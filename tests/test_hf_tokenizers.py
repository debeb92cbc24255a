"""Imported tokenizers of the Llama and Mistral families (<s>, </s>, <unk>; no <|endoftext|>) work end
to end: `kiln import hf`, then `kiln generate` (stops at </s>), `kiln serve`'s chat path (the
tokenizer's own chat template), `kiln eval`, and `kiln export hf` back to a folder transformers loads
with the same eos/bos, ids and logits. transformers is the reference throughout."""

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from kiln_testing.models import randomise  # noqa: E402

from kiln.cli import main  # noqa: E402
from kiln.data.chat import chat_stop_ids, render_prompt  # noqa: E402
from kiln.data.tokenizer import Tokenizer  # noqa: E402
from kiln.errors import DataError  # noqa: E402
from kiln.infer.config import SampleConfig  # noqa: E402
from kiln.infer.samples import sample_texts  # noqa: E402
from kiln.model import ModelConfig, build_model  # noqa: E402

TEXT = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "def add(a, b): return a + b",
    "Kiln turns raw text into a model, one token at a time.",
    "what is two plus two? it is four.",
] * 8
# A Mistral-like instruction template (written for this test): bos once, [INST] around user turns,
# eos after each reply; a system message is refused, as Mistral's own template does.
INST_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('only user and assistant roles are supported') }}{% endif %}"
    "{% endfor %}"
)
PROMPT = "hello world"
MAX_NEW = 30


def sentencepiece_style_tokenizer(folder: Path, family: str, chat_template: str | None = None):
    """A SentencePiece-style tokenizer.json (Metaspace) with <unk>, <s>, </s> first and a post-processor
    that adds <s>, as Llama's and Mistral's are: BPE for "llama", Unigram for "mistral"; plus the
    tokenizer_config.json and special_tokens_map.json that name them."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>"]
    if family == "llama":
        hf = HFTokenizer(models.BPE(unk_token="<unk>"))
        trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=specials, show_progress=False)
    else:
        hf = HFTokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(
            vocab_size=200, special_tokens=specials, unk_token="<unk>", show_progress=False
        )
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    hf.train_from_iterator(TEXT + ["[INST] [/INST]"], trainer)
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder.mkdir(parents=True, exist_ok=True)
    hf.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "lstrip": False, "normalized": False, "rstrip": False, "special": True},
        "unk_token": "<unk>",
        "pad_token": None,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return hf


def hf_folder(folder: Path, family: str, chat_template: str | None = None) -> Path:
    """A tiny random Llama/Mistral with its tokenizer, saved as a Hugging Face folder. </s>'s output
    row is set so that transformers' greedy generation from PROMPT stops at </s> after a few tokens,
    not at once and not never."""
    hf_tok = sentencepiece_style_tokenizer(folder, family, chat_template)
    vocab = hf_tok.get_vocab_size()
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    extra = {"sliding_window": None} if family == "mistral" else {}
    config = config_cls(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=1000.0,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    torch.manual_seed(0)
    model = randomise(model_cls(config)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        model.lm_head.weight[2] = 0.0
        out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        run = model(out, output_hidden_states=True)
        hidden = run.hidden_states[-1][0, ids.shape[1] - 1 : -1]  # after the final norm: what lm_head reads
        best = run.logits[0, ids.shape[1] - 1 : -1].max(-1).values
        # </s>'s row becomes c * (the hidden state at step t): the greedy path is unchanged until </s>
        # first wins, which happens at step t when c beats t's best logit there but at no earlier step.
        for t in range(3, MAX_NEW - 5):
            dots = hidden[: t + 1] @ hidden[t]
            needed = torch.where(dots > 0, best[: t + 1] / dots, torch.full_like(dots, float("inf")))
            if needed[t] < needed[:t].min():
                model.lm_head.weight[2] = (needed[t] + needed[:t].min()) / 2 * hidden[t]
                break
        else:
            raise AssertionError("no step where </s> can be made the first greedy choice")
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["llama", "mistral"])
def imported(request, tmp_path_factory):
    """(family, HF folder, Kiln checkpoint from `kiln import hf`); Mistral's has a chat template."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    folder = hf_folder(root / "hf", family, INST_TEMPLATE if family == "mistral" else None)
    assert main(["import", "hf", str(folder), str(root / "ckpt")]) == 0
    return family, folder, root / "ckpt"


def test_roles_come_from_the_tokenizer_config(imported):
    family, folder, ckpt = imported
    tok = Tokenizer.load(ckpt)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    assert (tok.special["eos_token"], tok.special["bos_token"]) == ("</s>", "<s>")
    assert (tok.eot_id, tok.bos_id, tok.prefix_id) == (reference.eos_token_id, reference.bos_token_id, 1)
    assert tok.pad_id is None and reference.pad_token_id is None
    assert (tok.chat_template is not None) == (family == "mistral")


def test_generate_stops_at_the_tokenizers_eos_as_transformers_does(imported, capsys):
    family, folder, ckpt = imported
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok(PROMPT, return_tensors="pt").input_ids  # <s> + the prompt: what kiln generate feeds
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=tok.eos_token_id)
    new = out[0, ids.shape[1] :].tolist()
    assert new[-1] == tok.eos_token_id and len(new) < MAX_NEW  # the reference stopped at </s>
    expected = tok.decode(ids[0, 1:].tolist() + new[:-1])
    capsys.readouterr()
    argv = ["generate", str(ckpt), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", str(MAX_NEW)]
    assert main([*argv, "--device", "cpu"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_export_back_loads_in_transformers_with_the_same_tokens_and_logits(imported, tmp_path):
    family, folder, ckpt = imported
    assert main(["export", "hf", str(ckpt), str(tmp_path / "out")]) == 0
    before = transformers.AutoTokenizer.from_pretrained(folder)
    after = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    for name in ("eos_token", "bos_token", "eos_token_id", "bos_token_id", "pad_token_id", "chat_template"):
        assert getattr(after, name) == getattr(before, name), name
    for text in TEXT[:4] + ["</s><s>two docs"]:
        assert after(text).input_ids == before(text).input_ids
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert (generation.bos_token_id, generation.eos_token_id) == (1, 2)
    original = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.tensor([before(TEXT[0]).input_ids])
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, original(tokens).logits, rtol=1e-5, atol=1e-5)


def test_chat_prompt_uses_the_tokenizers_template_or_refuses(imported):
    family, folder, ckpt = imported
    tok = Tokenizer.load(ckpt)
    messages = [
        {"role": "user", "content": "what is two plus two?"},
        {"role": "assistant", "content": "four."},
        {"role": "user", "content": "and three?"},
    ]
    if family == "llama":
        with pytest.raises(DataError, match="has no chat format"):
            render_prompt(tok, messages)
        return
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert render_prompt(tok, messages) == list(expected)
    assert chat_stop_ids(tok) == (2,)
    with pytest.raises(DataError, match="only user and assistant roles"):
        render_prompt(tok, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])


def test_serve_chat_completions_with_the_template(imported):
    from fastapi.testclient import TestClient

    from kiln.infer.load import load_for_inference
    from kiln.serve.app import create_app

    family, folder, ckpt = imported
    model, tok = load_for_inference(ckpt)
    messages = [{"role": "user", "content": "hello world"}]
    with TestClient(create_app(model, tok, model_name="m")) as client:
        info = client.get("/tokenizer_info").json()
        body = {"model": "m", "messages": messages, "max_tokens": MAX_NEW, "temperature": 0}
        reply = client.post("/v1/chat/completions", json=body)
    assert (info["eos_token"], info["bos_token"]) == ("</s>", "<s>")
    if family == "llama":
        assert reply.status_code == 400 and "has no chat format" in reply.json()["error"]["message"]
        assert info["chat_template"] is None
        return
    assert info["chat_template"] == INST_TEMPLATE
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = reference.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=False)
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=2)
    new = out[0, ids.shape[1] :].tolist()
    choice = reply.json()["choices"][0]
    stopped = new[-1] == 2
    assert choice["finish_reason"] == ("stop" if stopped else "length")
    assert choice["message"]["content"] == reference.decode(new[:-1] if stopped else new, skip_special_tokens=True)


def test_eval_scores_rolling_perplexity_after_bos_as_transformers(imported, tmp_path):
    family, folder, ckpt = imported
    doc = TEXT[0] + " " + TEXT[1]
    (tmp_path / "doc.txt").write_text(doc)
    argv = ["eval", str(ckpt), "--tasks", "perplexity", "--text", str(tmp_path / "doc.txt"), "--out", str(tmp_path)]
    assert main([*argv, "--device", "cpu", "--log-samples", "--name", "ppl"]) == 0
    sample = json.loads((tmp_path / "eval" / "ppl.samples.jsonl").read_text().splitlines()[0])
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = reference(doc, return_tensors="pt").input_ids  # <s> + the document: the first window's context
    with torch.no_grad():
        logprobs = hf(ids).logits[0, :-1].log_softmax(-1)
    expected = logprobs.gather(1, ids[0, 1:, None]).sum().item()
    assert sample["tokens"] == ids.shape[1] - 1
    assert sample["ll"] == pytest.approx(expected, abs=1e-3)


def test_a_tokenizer_without_eos_is_a_named_error_where_eos_is_needed(tmp_path):
    sentencepiece_style_tokenizer(tmp_path, "llama")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": None}))
    (tmp_path / "special_tokens_map.json").unlink()
    tok = Tokenizer.load(tmp_path)
    assert tok.encode("hello world")  # plain encoding needs no eos
    model = build_model(ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=2, max_seq_len=32))
    with pytest.raises(DataError, match="has no end-of-text token"):  # generation must know where to stop
        sample_texts(model, tok, SampleConfig(prompt="hello", max_new_tokens=4))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_end|>"}))
    with pytest.raises(DataError, match=r"tokenizer_config.json: eos_token: '<\|im_end\|>' is not in the vocabulary"):
        Tokenizer.load(tmp_path)
