"""Helpers shared by Kiln's tests.

pytest puts tests/ on sys.path (pyproject.toml: "tests" in pythonpath, with --import-mode=importlib),
so any test module imports these as `from kiln_testing.models import Scripted`. The name is
kiln_testing, not helpers or utils, so that it neither shadows nor is shadowed by an installed
package. Where tests/conftest.py wraps a helper in a fixture (a trained tokenizer, a pack factory),
tests take the fixture; the plain function is for code that cannot take fixtures.

- models: Scripted, ForcesToken (models whose next token is forced), randomise (random weights).
- text: stdlib_texts, stdlib_chunks (real text from the standard library's own sources).
- tokenizer: train_tiny_tokenizer (Kiln's own BPE), train_byte_bpe (a bare byte-level BPE).
- train: make_tiny_pack (a learnable synthetic token pack in the data contract's layout) and
  tiny_train_config (a TrainConfig for a few CPU steps on it).
- serving: serving (`kiln serve`'s app under uvicorn in a thread).
- lm_eval_tasks: write_lm_eval_tasks (three custom lm-eval tasks over local JSONL).
- fuzz: no_hang, fuzz_examples, fuzz_settings (Hypothesis budgets and a hang alarm).
"""
