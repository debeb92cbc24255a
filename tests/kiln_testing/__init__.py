"""Helpers shared by Kiln's tests.

pytest puts tests/ on sys.path (pyproject.toml: pythonpath = ["tests"], with --import-mode=importlib),
so any test module imports these as `from kiln_testing.serving import serving`. The package's name
is one no installed distribution uses. Fixtures that wrap these helpers live in tests/conftest.py;
use the helpers directly only where a fixture cannot reach (a worker script, a helper of a helper).

- models: Scripted, ForcesToken (models whose next token is forced), randomise (random weights).
- text: stdlib_chunks (real text from the standard library's own sources).
- tokenizer: train_byte_bpe (a bare byte-level BPE).
- pack: make_tiny_pack (a learnable synthetic token pack in the data contract's layout).
- serving: serving (`kiln serve`'s app under uvicorn in a thread).
- fuzz: no_hang, fuzz_examples, fuzz_settings (Hypothesis budgets and a hang alarm).
"""
