import pickle
import re
from pathlib import Path

import pytest

from kiln.data.steps.base import STEPS, build_step
from kiln.data.steps.quality import (
    C4Quality,
    FineWebQuality,
    GopherQuality,
    GopherRepetition,
    cjk_ngram_size,
    dup_ngram_char_fraction,
    duplicate_fractions,
    fineweb_stats,
    gopher_quality_stats,
    gopher_repetition_stats,
    top_ngram_char_fraction,
)
from kiln.errors import ConfigError

ZH_FORTUNES = Path("/usr/share/games/fortunes/chinese")

EN = (
    "The quality of a language model is limited by the data it is trained on. Before training, we "
    "clean the corpus: duplicate pages are removed, pages that only hold navigation links are "
    "dropped, and broken characters are replaced. The benefit is easy to see, because the model "
    "does not spend its capacity memorising text that carries no meaning. For English text we "
    "count words by splitting on whitespace and stripping punctuation, which matches the rules "
    "published with the Gopher models. This method is simple, yet it works well in practice and "
    "is fast enough to run on every document."
)
ZH = (
    "数据质量决定了模型的上限。我们在训练之前先清洗语料：去掉重复的网页，删除只有导航链接的页面，"
    "并把乱码和控制字符替换掉。这样做的好处是显而易见的，模型不必浪费算力去记忆无意义的内容。"
    "对于中文文本，我们按字计算词数，因为中文句子里没有空格。这个方法简单，但是在实践中效果很好。"
)


def doc(text, lang=None):
    return {"id": "d", "text": text, "source": "test", "meta": {"lang": lang} if lang else {}}


def test_all_registered():
    for name, cls in [
        ("gopher_quality", GopherQuality),
        ("gopher_repetition", GopherRepetition),
        ("c4", C4Quality),
        ("fineweb", FineWebQuality),
    ]:
        assert STEPS[name] is cls


def test_clean_prose_passes_every_filter_in_both_languages():
    for text, lang in [(EN, None), (EN, "en"), (ZH, None), (ZH, "zh")]:
        for step in (GopherQuality(), GopherRepetition(), C4Quality(), FineWebQuality()):
            assert step.reason(doc(text, lang)) is None, (step.name, lang)


# ---------------------------------------------------------------- Gopher quality


def words_doc(ws):
    return doc(" ".join(ws))


def test_gopher_word_count_bounds():
    step = GopherQuality()
    base = ["the", "and"]
    assert step.reason(words_doc(base + ["house"] * 48)) is None
    assert step.reason(words_doc(base + ["house"] * 47)) == "gopher_too_few_words"
    assert step.reason(words_doc(base + ["house"] * 99_998)) is None
    assert step.reason(words_doc(base + ["house"] * 99_999)) == "gopher_too_many_words"


def test_gopher_mean_word_length_bounds():
    step = GopherQuality()
    assert step.reason(words_doc(["the", "and"] + ["cat"] * 48)) is None  # mean 3.0
    assert step.reason(words_doc(["the", "and", "at"] + ["cat"] * 47)) == "gopher_short_words"
    long10, long17 = "abcdefghij", "abcdefghijklmnopq"
    assert step.reason(words_doc(["the", "and"] + [long10] * 46 + [long17] * 2)) is None  # mean 10.0
    assert step.reason(words_doc(["the", "and"] + [long10] * 46 + [long17, long17 + "x"])) == "gopher_long_words"


def test_gopher_hash_and_ellipsis_ratios_each_checked():
    step = GopherQuality()
    plain = ["the", "and"] + ["house"] * 48
    assert step.reason(words_doc(["#" + w for w in plain[:5]] + plain[5:])) is None  # 5/50 = 0.1
    assert step.reason(words_doc(["#" + w for w in plain[:6]] + plain[6:])) == "gopher_hash_ratio"
    assert step.reason(words_doc([w + "..." for w in plain[:4]] + ["house…"] + plain[5:] + ["end."])) is None
    assert step.reason(words_doc([w + "..." for w in plain[:6]] + plain[6:] + ["end."])) == "gopher_ellipsis_ratio"


def lines_doc(n_lines, special, make):
    body = "the house and the garden were quiet tonight"
    return doc("\n".join(make(f"{body} {i}") if i < special else f"{body} {i}." for i in range(n_lines)))


def test_gopher_bullet_lines():
    step = GopherQuality()
    assert step.reason(lines_doc(10, 9, lambda s: "• " + s)) is None
    assert step.reason(lines_doc(10, 10, lambda s: "- " + s)) == "gopher_bullet_lines"


def test_gopher_ellipsis_lines():
    step = GopherQuality()
    assert step.reason(lines_doc(10, 3, lambda s: s + "...")) is None
    assert step.reason(lines_doc(10, 4, lambda s: s + "…")) == "gopher_ellipsis_lines"


def test_gopher_alphabetic_words():
    step = GopherQuality()
    base = ["the", "and"] + ["house"] * 38
    assert step.reason(words_doc(base + ["123"] * 10)) is None  # 40/50 = 0.8
    assert step.reason(words_doc(base[:-1] + ["123"] * 11)) == "gopher_alpha_words"


def test_gopher_stop_words_distinct():
    step = GopherQuality()
    assert step.reason(words_doc(["the", "with"] + ["house"] * 48)) is None
    assert step.reason(words_doc(["the"] * 10 + ["house"] * 40)) == "gopher_stop_words"


def test_gopher_chinese_uses_characters_and_zh_stop_words():
    s = gopher_quality_stats(ZH, "zh")
    assert s["cjk"] and s["mean_word_length"] is None and s["alpha_words"] > 0.99
    assert s["words"] > 100 and s["stop_words"] >= 5
    step = GopherQuality()
    assert step.reason(doc(ZH, "zh")) is None
    assert step.stats.counters["mean_word_length_skipped_cjk"] == 1
    # Read with whitespace words the same text would be a handful of huge "words".
    assert step.reason(doc(ZH, "en")) == "gopher_too_few_words"
    no_function_words = "山高月小水落石出" * 8
    assert step.reason(doc(no_function_words, "zh")) == "gopher_stop_words"


def test_gopher_language_without_stop_list_skips_that_rule():
    step = GopherQuality()
    german = " ".join(["Haus", "Garten", "Wasser", "Baum", "Himmel"] * 12)
    assert step.reason(doc(german, "de")) is None
    assert step.stats.counters["stop_words_skipped_no_list"] == 1


# ---------------------------------------------------------------- Gopher repetition: definitions


def test_duplicate_fractions_count_repeats_after_the_first():
    assert duplicate_fractions(["a", "b", "a", "c"]) == (0.25, 0.25)
    assert duplicate_fractions(["aaaa", "b", "aaaa"]) == (1 / 3, 4 / 9)
    assert duplicate_fractions([]) == (0.0, 0.0)


def test_top_ngram_worked_examples():
    # ("the", "cat") occurs twice: 4 of 5 words, 12 of 15 characters.
    assert top_ngram_char_fraction(["the", "cat", "the", "cat", "sat"], 2) == 12 / 15
    # Overlapping occurrences of ("a", "a") cover each word once, so the fraction never exceeds 1.
    assert top_ngram_char_fraction(["a", "a", "a"], 2) == 1.0
    # An n-gram seen once is not repetition.
    assert top_ngram_char_fraction(["one", "two", "three"], 2) == 0.0
    # Ties go to the longer n-gram.
    assert top_ngram_char_fraction(["ab", "cd", "x", "ab", "cd", "longer", "word", "y", "longer", "word"], 2) == 20 / 30


def test_dup_ngram_worked_examples():
    ws = list("abcde") + ["x", "y", "z"] + list("abcde")
    assert dup_ngram_char_fraction(ws, 5) == 10 / 13
    assert dup_ngram_char_fraction(ws, 6) == 0.0
    # Six identical words: 5-grams at 0 and 1 overlap; every character counted once.
    assert dup_ngram_char_fraction(["w"] * 6, 5) == 1.0


def test_cjk_ngram_sizes():
    assert [cjk_ngram_size(n, 1.5) for n in (2, 3, 4, 5, 6, 7, 8, 9, 10)] == [3, 5, 6, 8, 9, 11, 12, 14, 15]
    assert cjk_ngram_size(4, 1.0) == 4


# ---------------------------------------------------------------- Gopher repetition: thresholds


RELAXED = dict(
    max_dup_line_fraction=1.0,
    max_dup_paragraph_fraction=1.0,
    max_dup_line_char_fraction=1.0,
    max_dup_paragraph_char_fraction=1.0,
    top_ngram_max_fractions={},
    dup_ngram_max_fractions={},
)


def only(**rule):
    return GopherRepetition(**{**RELAXED, **rule})


def numbered(prefix, n):
    return [f"{prefix}{i:03d}" for i in range(n)]  # equal-length distinct words


@pytest.mark.parametrize(
    "sep,key,reason",
    [
        ("\n", "max_dup_line_fraction", "gopher_dup_lines"),
        ("\n\n", "max_dup_paragraph_fraction", "gopher_dup_paragraphs"),
    ],
)
def test_duplicate_line_and_paragraph_fraction(sep, key, reason):
    step = only(**{key: 0.3})
    items = [f"unique item number {w} here" for w in numbered("u", 7)]
    assert step.reason(doc(sep.join(items + [items[0]] * 3))) is None  # 3/10
    assert step.reason(doc(sep.join(items + [items[0]] * 4))) == reason  # 4/11


@pytest.mark.parametrize(
    "sep,key,reason",
    [
        ("\n", "max_dup_line_char_fraction", "gopher_dup_line_chars"),
        ("\n\n", "max_dup_paragraph_char_fraction", "gopher_dup_paragraph_chars"),
    ],
)
def test_duplicate_line_and_paragraph_characters(sep, key, reason):
    step = only(**{key: 0.2})
    items = [f"unique item number {w} here" for w in numbered("u", 8)]
    assert step.reason(doc(sep.join(items + [items[0]] * 2))) is None  # 2/10 of characters
    assert step.reason(doc(sep.join(items + [items[0]] * 3))) == reason  # 3/11


@pytest.mark.parametrize("n,limit,keep_times,drop_times", [(2, 0.20, 5, 6), (3, 0.18, 3, 4), (4, 0.16, 2, 3)])
def test_top_ngram_thresholds(n, limit, keep_times, drop_times):
    step = only(top_ngram_max_fractions={str(n): limit})
    gram = numbered("r", n)

    def text(times):  # 50 equal-length words, the n-gram repeated `times` times
        return " ".join(gram * times + numbered("f", 50 - n * times))

    assert step.reason(doc(text(keep_times))) is None
    assert step.reason(doc(text(drop_times))) == f"gopher_top_{n}gram"


@pytest.mark.parametrize("n", [5, 6, 7, 8, 9, 10])
def test_duplicated_ngram_thresholds(n):
    limit = (20 - n) / 100  # 0.15, 0.14, ..., 0.10
    step = only(dup_ngram_max_fractions={str(n): limit})

    def text(m):  # 200 equal-length words, a block of m >= n words appearing twice
        block = numbered("r", m)
        return " ".join(block + numbered("f", 200 - 2 * m) + block)

    m = 20 - n  # 2m of 200 words covered = the limit exactly
    assert step.reason(doc(text(m))) is None
    assert step.reason(doc(text(m + 1))) == f"gopher_dup_{n}gram"


def test_repetition_defaults_are_the_papers():
    step = GopherRepetition()
    assert (step.max_dup_line_fraction, step.max_dup_paragraph_fraction) == (0.3, 0.3)
    assert (step.max_dup_line_char_fraction, step.max_dup_paragraph_char_fraction) == (0.2, 0.2)
    assert step.top_ngram_max_fractions == {"2": 0.2, "3": 0.18, "4": 0.16}
    assert step.dup_ngram_max_fractions == {str(n): (20 - n) / 100 for n in range(5, 11)}


def test_repetition_chinese_spam_dropped_real_prose_kept():
    step = GopherRepetition()
    assert step.reason(doc(ZH, "zh")) is None
    spam = "。".join(["点击这里立即领取优惠券"] * 6 + ["今天天气很好我们一起去公园散步吧"])
    assert step.reason(doc(spam, "zh")) is not None
    s = gopher_repetition_stats(spam, "zh")
    assert s["dup_ngram"][5] > 0.5


def test_repetition_config_from_recipe_table():
    step = build_step("gopher_repetition", {"top_ngram_max_fractions": {"2": 0.25}}, "data.gopher_repetition")
    assert step.top_ngram_max_fractions == {"2": 0.25}
    with pytest.raises(ConfigError, match=r"data\.gopher_repetition\.dup_ngram_max_fractions\.x"):
        build_step("gopher_repetition", {"dup_ngram_max_fractions": {"x": 0.1}}, "data.gopher_repetition")
    with pytest.raises(ConfigError, match=r"top_ngram_max_fractions\.2"):
        GopherRepetition(top_ngram_max_fractions={"2": 1.5}).validate()


# ---------------------------------------------------------------- C4

S = "This line is a complete sentence with enough words."


def test_c4_terminal_punctuation_and_ellipsis():
    step = C4Quality()
    text = "\n".join([S, "A heading without an end mark", S, "Trailing off like this one does...", S])
    out, why, counts = step.clean(text)
    assert why is None and out == "\n".join([S, S, S])
    assert counts["lines_no_terminal_punct"] == 2
    # FineWeb's configuration keeps lines without end marks.
    out, why, _ = C4Quality(filter_no_terminal_punct=False).clean(text)
    assert why is None and "A heading without an end mark" in out


def test_c4_min_words_per_line_both_sides():
    step = C4Quality()
    out, _, counts = step.clean("\n".join([S, "Five words are right here.", "Four words are here.", S, S]))
    assert "Five words are right here." in out and "Four words" not in out
    assert counts["lines_too_few_words"] == 1


def test_c4_min_sentences_both_sides():
    step = C4Quality()
    assert step.reason(doc(f"{S} {S}\n{S}")) is None  # 3 sentences
    assert step.reason(doc(f"{S} {S}")) == "c4_too_few_sentences"  # 2
    # datatrove / FineWeb reading: 5 sentences, 3 words per line.
    fineweb_c4 = C4Quality(min_sentences=5, min_words_per_line=3)
    assert fineweb_c4.reason(doc(" ".join([S] * 4))) == "c4_too_few_sentences"
    assert fineweb_c4.reason(doc(" ".join([S] * 4) + "\nShort but fine.")) is None


def test_c4_max_word_length_both_sides():
    step = C4Quality()
    ok, bad = "x" * 1000, "x" * 1001
    out, _, counts = step.clean(
        "\n".join([S, f"A word {ok} is long but allowed.", f"A word {bad} is too long here.", S, S])
    )
    assert ok in out and bad not in out and counts["lines_long_word"] == 1


def test_c4_page_rules_lorem_ipsum_and_curly_bracket():
    step = C4Quality()
    original = "\n".join([S, "Lorem ipsum dolor sit amet, consectetur adipiscing elit.", S, S])
    d = doc(original)
    assert step.reason(d) == "c4_lorem_ipsum" and d["text"] == original  # dropped docs stay as they came
    assert step.reason(doc("\n".join([S, "function f() { return a + b; } is code here.", S, S]))) == "c4_curly_bracket"
    # As in the reference code, only a line that passed the line rules can drop the page.
    assert step.reason(doc("\n".join([S, "if (x) {", S, S]))) is None
    assert step.reason(doc("\n".join([S, "lorem ipsum", S, S]))) is None


def test_c4_line_rules_javascript_policy_citations():
    step = C4Quality()
    d = doc(
        "\n".join(
            [
                S,
                "Please enable JavaScript in your browser to continue.",
                "Read our privacy policy before you sign up today.",
                "The tower was finished in 1889 [1] and painted often[citation needed].",
                S,
                S,
            ]
        )
    )
    assert step.reason(d) is None
    assert d["text"] == "\n".join([S, "The tower was finished in 1889  and painted often.", S, S])
    c = step.stats.counters
    assert (c["lines_javascript"], c["lines_policy"], c["citations_removed"], c["docs_edited"]) == (1, 1, 2, 1)


def test_c4_paragraph_breaks():
    text = f"{S}\n\n{S}\nno end mark\n\n\n{S}"
    assert C4Quality().clean(text)[0] == f"{S}\n\n{S}\n\n{S}"
    assert C4Quality(keep_paragraph_breaks=False).clean(text)[0] == f"{S}\n{S}\n{S}"


def test_c4_chinese_lines_and_sentences():
    step = C4Quality()
    text = "导航 首页\n今天我们学习怎样清洗数据。这很重要！\n第二段也有完整的句子。\n好的。"
    out, why, counts = step.clean(text, "zh")
    assert why is None
    assert out == "今天我们学习怎样清洗数据。这很重要！\n第二段也有完整的句子。"
    assert counts["lines_no_terminal_punct"] == 1 and counts["lines_too_few_words"] == 1


# ---------------------------------------------------------------- FineWeb

LONG = "this line is clearly longer than thirty characters"


def test_fineweb_line_punctuation_both_sides():
    step = FineWebQuality(max_short_line_ratio=1.0, max_dup_line_char_ratio=1.0)
    lines_ = [f"{LONG} {i}" for i in range(25)]
    keep = [l + "." if i < 3 else l for i, l in enumerate(lines_)]  # 3/25 = 0.12
    drop = [l + "." if i < 2 else l for i, l in enumerate(lines_)]  # 2/25
    assert step.reason(doc("\n".join(keep))) is None
    assert step.reason(doc("\n".join(drop))) == "fineweb_line_punct"


def test_fineweb_short_lines_both_sides():
    step = FineWebQuality(min_line_punct_ratio=0.0, max_dup_line_char_ratio=1.0)
    short30 = "x" * 29 + "."  # exactly 30 characters counts as short
    not_short = "x" * 30 + "."
    assert step.reason(doc("\n".join([short30, short30 + " ", not_short]))) is None  # 2/3
    assert step.reason(doc("\n".join([short30, "b" * 29 + ".", "c" * 29 + ".", not_short]))) == "fineweb_short_lines"


def test_fineweb_cjk_character_width():
    ten, eleven = "数据质量决定模型上限。"[:10], "数据质量决定模型上限。"
    assert fineweb_stats(ten, "zh")["short_lines"] == 1.0
    assert fineweb_stats(eleven, "zh")["short_lines"] == 0.0
    assert fineweb_stats(ten, "zh", cjk_char_width=1.0)["short_lines"] == 1.0


def test_fineweb_duplicate_line_characters_both_readings():
    step = FineWebQuality()
    items = [f"{LONG} {i:02d}." for i in range(9)]
    assert step.reason(doc("\n".join(items + [items[0]]))) is None  # 1/10 = 0.1 (paper)
    assert step.reason(doc("\n".join(items[:8] + [items[0]] * 2))) == "fineweb_dup_line_chars"
    datatrove = FineWebQuality(max_dup_line_char_ratio=0.01)
    assert datatrove.reason(doc("\n".join(items + [items[0]]))) == "fineweb_dup_line_chars"


def test_fineweb_newline_rule_off_by_default():
    text = "\n".join(f"Line {i} ends here." for i in range(10))  # 9 newlines, 40 words
    assert FineWebQuality(max_short_line_ratio=1.0).reason(doc(text)) is None
    assert FineWebQuality(max_short_line_ratio=1.0, max_newline_word_ratio=0.2).reason(doc(text)) == "fineweb_newlines"
    assert FineWebQuality(max_short_line_ratio=1.0, max_newline_word_ratio=0.3).reason(doc(text)) is None


# ---------------------------------------------------------------- config, pickling, real text


@pytest.mark.parametrize(
    "name,table,key",
    [
        ("gopher_quality", {"min_alpha_words_ratio": 1.5}, "min_alpha_words_ratio"),
        ("gopher_quality", {"min_doc_words": 200, "max_doc_words": 100}, "min_doc_words"),
        ("c4", {"max_word_length": 0}, "max_word_length"),
        ("fineweb", {"end_marks": ""}, "end_marks"),
        ("fineweb", {"cjk_char_width": 0.5}, "cjk_char_width"),
    ],
)
def test_bad_config_names_the_key(name, table, key):
    with pytest.raises(ConfigError, match=rf"data\.{name}\.{key}"):
        build_step(name, table, f"data.{name}")


def test_steps_pickle():
    for step in (GopherQuality(), GopherRepetition(), C4Quality(), FineWebQuality()):
        clone = pickle.loads(pickle.dumps(step))
        assert clone.reason(doc(EN)) is None


def test_real_english_docs():
    from pydoc_data.topics import topics

    prose = [t for t in topics.values() if len(t.split()) >= 300]
    assert len(prose) >= 30
    quality = [gopher_quality_stats(t) for t in prose]
    # Real documentation: words of ordinary length, mostly alphabetic, full of stop words.
    assert all(3 <= s["mean_word_length"] <= 10 for s in quality)
    assert all(s["stop_words"] >= 2 for s in quality)
    kept = sum(GopherQuality().reason(doc(t)) is None for t in prose)
    assert kept >= 0.9 * len(prose)
    # The reference manual repeats grammar productions; repetition drops some but not most.
    kept = sum(GopherRepetition().reason(doc(t)) is None for t in prose)
    assert 0.5 * len(prose) <= kept < len(prose)


@pytest.mark.skipif(not ZH_FORTUNES.exists(), reason="Debian fortunes-zh not installed")
def test_real_chinese_text():
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    records = [ansi.sub("", r).strip() for r in ZH_FORTUNES.read_text(encoding="utf-8").split("\n%\n")]
    long_records = [r for r in records if len(r) >= 200][:400]
    assert len(long_records) == 400
    step = GopherQuality()
    reasons = [step.reason(doc(r)) for r in long_records]
    # Chinese prose is judged on its own terms: no alphabetic or word-length rejections en masse.
    assert sum(r is None for r in reasons) >= 0.6 * len(reasons)
    assert reasons.count("gopher_alpha_words") <= 0.1 * len(reasons)
    assert "gopher_short_words" not in reasons
    reasons = [GopherRepetition().reason(doc(r)) for r in long_records]
    assert sum(r is None for r in reasons) >= 0.6 * len(reasons)
    # Most drops are real repeated lines (tables, shell sessions); character n-grams scaled to word
    # length do not reject Chinese prose wholesale.
    assert sum(r is not None and "gram" in r for r in reasons) <= 0.15 * len(reasons)
    reasons = [FineWebQuality().reason(doc(r)) for r in long_records]
    assert sum(r is None for r in reasons) >= 0.6 * len(reasons)
    # Counting a Han character as 3 columns keeps ordinary Chinese lines from reading as "short";
    # the line-punctuation drops are hard-wrapped manual text, as they would be in English.
    assert reasons.count("fineweb_short_lines") <= 0.05 * len(reasons)
