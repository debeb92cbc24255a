"""The KV-cache engine with scaled RoPE, past the original context."""

import pytest
import torch

from kiln.infer.kv_cache import KVCache
from kiln.model import ModelConfig, build_model
from kiln.model.config import RopeScaling

pytestmark = pytest.mark.usefixtures("one_thread")

ORIGINAL = 16


def scaled_model(scaling: RopeScaling):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, init_std=0.2)
    cfg.rope_scaling = scaling
    return build_model(cfg).eval()


@pytest.mark.parametrize(
    "scaling",
    [RopeScaling("yarn", 4.0, ORIGINAL), RopeScaling("llama3", 4.0, ORIGINAL), RopeScaling("linear", 4.0)],
    ids=["yarn", "llama3", "linear"],
)
def test_cached_decode_equals_uncached_forward_past_the_original_context(scaling):
    model = scaled_model(scaling)
    torch.manual_seed(1)
    rows = [torch.randint(0, 300, (n,)).tolist() for n in (12, 20)]  # one inside, one past 16
    longest = max(map(len, rows))
    cache = KVCache.for_model(model, len(rows), 60)
    with torch.no_grad():
        model(torch.tensor([r + [0] * (longest - len(r)) for r in rows]), kv_cache=cache)
        cache.set_lengths([len(r) for r in rows])
        for step in range(36):  # up to 56 tokens: 3.5x the original context
            new = [(7 * step + 13 * b) % 300 for b in range(len(rows))]
            rows = [r + [t] for r, t in zip(rows, new)]
            logits = model(torch.tensor(new)[:, None], kv_cache=cache)[:, -1]
            for b, r in enumerate(rows):
                torch.testing.assert_close(logits[b], model(torch.tensor([r]))[0, -1], rtol=0, atol=1e-4)


def test_dynamic_decode_follows_transformers_cached_generation(tmp_path):
    """Dynamic NTK rescales with the length of each forward; cached keys keep the rotation they were
    computed with. That is what transformers' cached generation does, step for step."""
    pytest.importorskip("transformers")
    from kiln_testing.hf_llama import hf_llama

    from kiln.hf import import_hf

    hf = hf_llama({"rope_type": "dynamic", "factor": 4.0}, ORIGINAL, vocab_size=300, hidden_size=32)
    hf.save_pretrained(tmp_path)
    cfg, state = import_hf(tmp_path)
    model = build_model(cfg).eval()
    model.load_state_dict(state)
    prompt = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(2))
    cache = KVCache.for_model(model, 1, cfg.max_seq_len)
    with torch.no_grad():
        out = hf(prompt, use_cache=True)
        torch.testing.assert_close(model(prompt, kv_cache=cache), out.logits, rtol=1e-4, atol=1e-4)
        past, tokens = out.past_key_values, prompt[0].tolist()
        for step in range(8):
            new = torch.tensor([[(11 * step + 3) % 300]])
            tokens.append(int(new))
            out = hf(new, past_key_values=past, use_cache=True)
            past = out.past_key_values
            ours = model(new, kv_cache=cache)
            torch.testing.assert_close(ours, out.logits, rtol=1e-4, atol=1e-4)
        # The uncached forward over the same tokens rotates every key at the final length's scale.
        assert (model(torch.tensor([tokens]))[0, -1] - ours[0, -1]).abs().max() > 1e-3
