import pickle
import unicodedata

import pytest

from kiln.data.steps.base import STEPS, build_step
from kiln.data.steps.normalize import Normalize, normalize_text
from kiln.errors import ConfigError


def run(step, text):
    step.setup()
    return step.apply({"id": "d", "text": text, "source": "s", "meta": {}})["text"]


def test_registered_by_name():
    assert STEPS["normalize"] is Normalize


def test_nfc_composes_combining_marks():
    decomposed = "cafe\u0301 re\u0301sume\u0301"
    step = Normalize()
    out = run(step, decomposed)
    assert out == "café résumé" and unicodedata.is_normalized("NFC", out)
    assert step.stats.counters["unicode_normalized_docs"] == 1


def test_nfkc_folds_fullwidth_only_when_asked():
    assert run(Normalize(), "ＡＢＣ１２３") == "ＡＢＣ１２３"
    assert run(Normalize(unicode_form="NFKC"), "ＡＢＣ１２３") == "ABC123"


def test_control_characters_removed_but_tab_and_newline_kept():
    step = Normalize()
    out = run(step, "a\x00b\x07c\td\ufeffe\u200bf\x9bg\nh\ud800i")
    assert out == "abc\tdefg\nhi"
    assert step.stats.counters["control_chars_removed"] == 6
    assert out.encode("utf-8")  # a lone surrogate would make this raise
    assert run(Normalize(remove_control_chars=False), "a\x07b") == "a\x07b"


def test_line_breaks_become_lf():
    step = Normalize()
    assert run(step, "one\r\ntwo\rthree\x0cfour\u2028five\u2029six") == "one\ntwo\nthree\nfour\nfive\n\nsix"
    assert step.stats.counters["line_breaks_converted"] == 5


def test_trailing_whitespace_and_blank_runs():
    step = Normalize()
    text = "\n\n  indented   \ntitle\u3000\u00a0\n\n\n\n\n\nbody\t\n\n\n\nend\n\n"
    out = run(step, text)
    # Leading indentation is kept (code); more than two blank lines collapse to two.
    assert out == "  indented\ntitle\n\n\nbody\n\n\nend"
    assert step.stats.counters["trailing_space_lines"] == 3
    assert step.stats.counters["blank_runs_collapsed"] == 2
    assert run(Normalize(max_blank_lines=1), "a\n\n\n\nb\n\nc") == "a\n\nb\n\nc"
    # Exactly max_blank_lines blank lines is left alone.
    assert run(Normalize(max_blank_lines=2), "a\n\n\nb") == "a\n\n\nb"


def test_boilerplate_off_by_default_and_short_lines_only_when_on():
    text = (
        "Welcome to the bakery.\n"
        "We use cookies to improve your experience.\n"
        "Our chocolate cookies recipe needs butter, sugar and flour.\n"
        "Please enable JavaScript to view this page.\n"
        "Copyright 2024 Example Ltd. All rights reserved.\n"
        + "This long paragraph explains our privacy policy in plain words so that every visitor "
        "understands exactly which data we keep, for how long, and why we keep it at all."
    )
    assert run(Normalize(), text) == text
    step = Normalize(remove_boilerplate=True)
    out = run(step, text)
    assert out.split("\n") == [
        "Welcome to the bakery.",
        "Our chocolate cookies recipe needs butter, sugar and flour.",
        text.split("\n")[-1],
    ]
    assert step.stats.counters["boilerplate_lines_removed"] == 3


def test_custom_boilerplate_patterns():
    step = Normalize(remove_boilerplate=True, boilerplate_patterns=[r"^share on \w+$"])
    assert run(step, "Share on Twitter\nreal text") == "real text"


def test_unchanged_document_counts_nothing():
    step = Normalize()
    assert run(step, "clean text\n\nsecond paragraph") == "clean text\n\nsecond paragraph"
    assert not step.stats.counters


def test_validation_names_the_key():
    with pytest.raises(ConfigError, match="unicode_form"):
        Normalize(unicode_form="NFD").validate()
    with pytest.raises(ConfigError, match=r"boilerplate_patterns\[1\]"):
        Normalize(boilerplate_patterns=["ok", "(unclosed"]).validate()
    with pytest.raises(ConfigError, match="max_blank_lines"):
        Normalize(max_blank_lines=-1).validate()
    with pytest.raises(ConfigError, match=r"data\.normalize\.unicode_form"):
        build_step("normalize", {"unicode_form": "bad"}, "data.normalize")


def test_build_from_recipe_table_and_pickle():
    step = build_step("normalize", {"remove_boilerplate": True, "boilerplate_patterns": ["foo bar"]}, "data.normalize")
    step.setup()
    clone = pickle.loads(pickle.dumps(step))
    assert run(clone, "x\nfoo bar\ny") == "x\ny"


def test_real_text_is_idempotent():
    from pydoc_data.topics import topics

    for text in list(topics.values())[:20]:
        once, _ = normalize_text(text)
        twice, counts = normalize_text(once)
        assert twice == once and not counts
