"""Fixtures shared by the post-training tests: one tokenizer trained on Kiln's task families and the
small model configuration most tests build on."""

import pytest

from kiln.data.config import TokenizerConfig
from kiln.data.tokenizer import Tokenizer, train_tokenizer
from kiln.model import ModelConfig
from kiln.post.tasks import FAMILIES, generate_tasks


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """A 512-token BPE tokenizer trained on prompts and answers of every task family."""
    out = tmp_path_factory.mktemp("post_tok")
    texts = [f"{e['prompt']} {e['answer']}" for f in FAMILIES for e in generate_tasks(f, 300, seed=3)]
    train_tokenizer(texts, TokenizerConfig(vocab_size=512, heldout_fraction=0.1), out, heldout=[])
    return Tokenizer.load(out)


@pytest.fixture
def model_cfg(tok):
    """model_cfg(**overrides): a 2-layer, dim-32 decoder over `tok`'s vocabulary."""

    def make(**overrides) -> ModelConfig:
        return ModelConfig(
            **{**dict(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4, max_seq_len=64), **overrides}
        )

    return make
