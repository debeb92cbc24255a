"""T5 generation through the engine: greedy output equals transformers' generate(do_sample=False) on
the same weights; the KV-cached decoder gives the logits of the uncached one; the encoder and the
cross-attention keys and values are computed once per prompt."""

import dataclasses

import pytest
import torch

from kiln.infer.engine import Engine
from kiln.infer.kv_cache import KVCache
from kiln.infer.seq2seq import prefill_seq2seq
from tests.model.test_t5 import TINY, hf_twin, make

# Weights 4x T5's init scale: at 1x this tiny random model repeats one token whatever the prompt,
# which would leave the comparisons below with little to check.
VARIED = dataclasses.replace(TINY, init_factor=4.0)
# As many decoder as encoder layers: transformers' generate sizes its cache by num_layers.
SYMMETRIC = dataclasses.replace(VARIED, n_decoder_layers=0)
PROMPTS = [[5, 17, 33, 8, 61, 12, 9], [44, 3, 70], [90, 91, 92, 93, 94, 95, 2, 3, 4, 5, 6]]


def test_greedy_matches_transformers_generate():
    model = make(SYMMETRIC, seed=2)
    hf = hf_twin(model)
    longest = max(map(len, PROMPTS))
    ids = torch.full((len(PROMPTS), longest), TINY.pad_id)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(PROMPTS):
        ids[row, : len(prompt)] = torch.tensor(prompt)
        mask[row, : len(prompt)] = 1
    with torch.no_grad():
        theirs = hf.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, num_beams=1,
            decoder_start_token_id=TINY.pad_id, eos_token_id=TINY.eos_id, pad_token_id=TINY.pad_id,
        )  # fmt: skip
    ours = Engine(model).generate(PROMPTS, max_new_tokens=12, temperature=0.0, stop_token_ids=[TINY.eos_id])
    for row, out in enumerate(ours):
        expected = theirs[row, 1:].tolist()  # after the start token
        if TINY.eos_id in expected:
            expected = expected[: expected.index(TINY.eos_id) + 1]
        assert out.ids == expected, row
    assert len({tuple(out.ids) for out in ours}) == len(PROMPTS)  # the prompts steer the output


def test_cached_decoding_equals_uncached_and_encodes_once():
    model = make(VARIED, seed=3)
    calls = {"encoder": 0, "cross_k": 0}
    model.encoder.layers[0].register_forward_hook(lambda *_: calls.__setitem__("encoder", calls["encoder"] + 1))
    model.decoder.layers[1].cross.k.register_forward_hook(lambda *_: calls.__setitem__("cross_k", calls["cross_k"] + 1))

    def make_cache(n_layers, batch, max_len):
        return KVCache(n_layers, batch, TINY.n_heads, max_len, TINY.head_dim)

    steps = 10
    with torch.no_grad():
        cache, logits, tokens = prefill_seq2seq(model, PROMPTS, steps, make_cache)
        cached = [logits]
        for _ in range(steps - 1):
            tokens = torch.cat([tokens, cached[-1].argmax(-1, keepdim=True)], dim=1)
            cached.append(model.decode(tokens[:, -1:], kv_cache=cache)[:, -1])
        assert cache.lengths == [steps] * len(PROMPTS)  # the self-attention cache grew one slot a step
        assert calls == {"encoder": 1, "cross_k": 1}
        # Uncached: the whole decoder sequence at once against the encoder output.
        src = torch.full((len(PROMPTS), max(map(len, PROMPTS))), TINY.pad_id)
        mask = torch.zeros_like(src, dtype=torch.bool)
        for row, prompt in enumerate(PROMPTS):
            src[row, : len(prompt)], mask[row, : len(prompt)] = torch.tensor(prompt), True
        full = model(src, tokens, mask)
    # Logits of this 4x-scaled model run to ~1e2: 1e-4 is float32 rounding at that size.
    torch.testing.assert_close(torch.stack(cached, dim=1), full, atol=1e-4, rtol=1e-5)


def test_rows_finish_independently():
    """A row that stops leaves the batch (the cross-attention state is dropped with it) and the
    others continue with the tokens they would have generated alone."""
    model = make(SYMMETRIC, seed=2)
    engine = Engine(model)
    together = engine.generate(PROMPTS, max_new_tokens=8, temperature=0.0, stop_token_ids=[7])
    for row, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], max_new_tokens=8, temperature=0.0, stop_token_ids=[7])[0]
        assert alone.ids == together[row].ids


@pytest.mark.parametrize("bad", [[[]], [[TINY.vocab_size]]])
def test_bad_prompts_are_refused(bad):
    from kiln.errors import ConfigError

    with pytest.raises(ConfigError, match="prompt"):
        Engine(make()).generate(bad, max_new_tokens=3)


def test_kiln_generate_runs_a_t5_checkpoint(tmp_path, kiln_tokenizer, capsys):
    """`kiln generate` on a T5 checkpoint: the prompt (after the tokenizer's prefix token) is the
    encoder input, and the greedy text is the uncached decoder's argmax continuation."""
    import shutil

    from kiln.checkpoint import save_weights
    from kiln.cli import main

    tok = kiln_tokenizer
    model = make(dataclasses.replace(SYMMETRIC, vocab_size=tok.vocab_size), seed=4)
    path = save_weights(tmp_path / "t5", model.cfg, model.state_dict(), {"step": 0})
    shutil.copy(tok.path, path / "tokenizer.json")
    capsys.readouterr()
    assert main(["generate", str(path), "--prompt", "def main(", "--max-new-tokens", "8", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    src = torch.tensor([[tok.prefix_id, *tok.encode("def main(")]])
    decoder = torch.tensor([[model.cfg.pad_id]])
    with torch.no_grad():
        for _ in range(8):
            token = model(src, decoder)[0, -1].argmax().item()
            if token == tok.eot_id:
                break
            decoder = torch.cat([decoder, torch.tensor([[token]])], dim=1)
    assert decoder.shape[1] > 2  # it generated something to compare
    assert printed == "def main(" + tok.decode(decoder[0, 1:].tolist()) + "\n"
