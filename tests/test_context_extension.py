"""The context-extension recipe's direction, at bench/context_extension.py's CPU scale (slow)."""

import runpy

import pytest


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")  # many small matmuls: a second thread only adds stalls
def test_continued_pretraining_with_yarn_beats_the_short_length_control(tmp_path):
    bench = runpy.run_path("bench/context_extension.py")
    args = bench["parse_args"](["--out", str(tmp_path), "--base-steps", "600", "--long-steps", "150"])
    base, base_plain, base_yarn, after, more_plain, more_yarn = bench["measure"](args).values()
    # Measured (docs/long_context.md): 4.157 plain, 4.123 yarn untrained, 4.032 after, control
    # 4.134 plain and 4.081 yarn. YaRN alone already reads 4x better than plain RoPE ...
    assert base_yarn < base_plain and more_yarn < more_plain
    # ... and training at the long length beats as many more tokens at the short one.
    assert after < more_yarn < more_plain
