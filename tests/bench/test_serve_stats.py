"""bench/serve.py's statistics: percentiles, SSE parsing, TTFT/ITL from chunk timestamps."""

import math
import runpy

import numpy as np
import pytest

bench = runpy.run_path("bench/serve.py")


@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.5, 0.4]
    assert bench["percentile"](values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_nothing_is_nan():
    assert math.isnan(bench["percentile"]([], 50))


def test_sse_payloads_stop_at_done_and_skip_other_lines():
    lines = ['data: {"a": 1}', "", ": comment", 'data:{"b": 2}', "data: [DONE]", 'data: {"c": 3}']
    assert bench["sse_payloads"](lines) == [{"a": 1}, {"b": 2}]


def test_timings_from_streamed_chunks():
    timing = bench["RequestTiming"](sent=10.0)
    chunks = [
        ({"choices": [{"index": 0, "text": "a"}], "usage": None}, 10.5),
        ({"choices": [{"index": 0, "text": ""}], "usage": None}, 10.6),  # held-back byte: not a token
        ({"choices": [{"index": 0, "text": "b"}], "usage": None}, 10.7),
        ({"choices": [{"index": 0, "text": "c"}], "usage": None}, 11.0),
        ({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4}}, 11.1),
    ]
    for payload, arrived in chunks:
        bench["observe_chunk"](timing, payload, arrived)
    assert timing.ttft == pytest.approx(0.5)
    assert timing.gaps == pytest.approx([0.2, 0.3])
    assert timing.completion_tokens == 4

    other = bench["RequestTiming"](sent=10.0, token_times=[10.1, 10.2], completion_tokens=2)
    stats = bench["summarize"]([timing, other], wall=2.0)
    assert stats["tokens"] == 6
    assert stats["tokens_per_s"] == pytest.approx(3.0)
    assert stats["ttft_p50"] == pytest.approx(0.3)
    assert stats["ttft_p99"] == pytest.approx(0.1 + 0.4 * 0.99)
    assert stats["itl_p50"] == pytest.approx(0.2)  # gaps 0.2, 0.3, 0.1
    assert stats["itl_p99"] == pytest.approx(0.2 + 0.1 * 0.98)


def test_compare_texts_tells_a_cut_character_from_a_different_token():
    compare = bench["compare_texts"]
    assert compare("ab c", "ab c") == "equal"
    assert compare("ab c\ufffd", "ab c") == "equal but the last character"
    assert compare("ab c", "ab d") == "differ"
    assert compare("ab c\ufffd", "ab d") == "differ"


def test_kiln_runs_sweep_one_option_against_its_zero_run():
    parse = bench["parse_args"]
    ckpt = ["--ckpt", "c", "--export", "e"]
    assert bench["kiln_runs"](parse(ckpt)) == ([("kiln", [])], None)
    runs, baseline = bench["kiln_runs"](parse([*ckpt, "--kiln-prefill-chunk-tokens", "0,64"]))
    assert runs == [
        ("kiln-chunk0", ["--prefill-chunk-tokens", "0"]),
        ("kiln-chunk64", ["--prefill-chunk-tokens", "64"]),
    ]
    assert baseline == ("kiln-chunk0", "chunked prefill on / off")
    runs, baseline = bench["kiln_runs"](parse([*ckpt, "--kiln-prefix-cache-mb", "0,256"]))
    assert [name for name, _ in runs] == ["kiln-pc0", "kiln-pc256"] and runs[1][1] == ["--prefix-cache-mb", "256"]
    runs, baseline = bench["kiln_runs"](parse([*ckpt, "--kiln-prepack", "0,1"]))
    assert runs == [("kiln-prepack0", []), ("kiln-prepack1", ["--prepack"])]
    with pytest.raises(SystemExit, match="one at a time"):
        bench["kiln_runs"](parse([*ckpt, "--kiln-prefix-cache-mb", "0,256", "--kiln-prefill-chunk-tokens", "0,64"]))
