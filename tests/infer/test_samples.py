"""The sample stage's texts (kiln.infer.samples.sample_texts) come from the engine under the recipe's
[sample] table, and are what the uncached reference generates with the same seeds."""

import pytest
import torch
from kiln_testing.reference_generate import reference_generate
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kiln.data.tokenizer import Tokenizer
from kiln.errors import ConfigError
from kiln.infer.config import SampleConfig
from kiln.infer.samples import sample_texts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(
        ["def main():\n    print('hello')\n"] * 3,
        trainers.BpeTrainer(
            vocab_size=280,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    path = tmp_path_factory.mktemp("tok")
    hf.save(str(path / "tokenizer.json"))
    return Tokenizer.load(path)


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0.9, top_k=20, top_p=0.9),
        dict(temperature=1.2, top_k=0, top_p=1.0, min_p=0.1, repetition_penalty=1.5),
        dict(temperature=0.0, repetition_penalty=2.0),
    ],
)
def test_sample_texts_are_the_references_continuations(byte_model, tokenizer, sampling):
    cfg = SampleConfig(prompt="def ", max_new_tokens=8, num_samples=3, seed=4, **sampling)
    texts = sample_texts(byte_model, tokenizer, cfg)
    assert len(texts) == 3
    # Each text is exactly the decoded continuation of [eot] + prompt that the reference draws with
    # sample i's generator, seeded with seed + i.
    prompt_ids = [tokenizer.eot_id] + tokenizer.encode("def ")
    for i, text in enumerate(texts):
        generator = torch.Generator().manual_seed(cfg.seed + i)
        new = reference_generate(
            byte_model, prompt_ids, 8, **sampling, generator=generator, stop_ids=(tokenizer.eot_id,)
        )
        assert text == tokenizer.decode(new)
    assert sample_texts(byte_model, tokenizer, cfg) == texts
    if sampling["temperature"] > 0:
        assert len(set(texts)) > 1  # each sample has its own seed


def test_a_prompt_that_fills_the_context_is_a_config_error(byte_model, tokenizer):
    with pytest.raises(ConfigError, match="sample.prompt"):
        sample_texts(byte_model, tokenizer, SampleConfig(prompt="def main(): print(1) " * 4))
