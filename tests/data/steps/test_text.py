from pathlib import Path

import pytest

from kiln.data.steps.text import (
    STOP_WORDS,
    base_lang,
    is_cjk,
    lines,
    ngrams,
    paragraphs,
    sentences,
    stop_word_lang,
    words,
)

ZH_FORTUNES = Path("/usr/share/games/fortunes/chinese")


def test_english_words_strip_edge_punctuation_only():
    assert words("Hello, world! Don't stop -- (yes) 3.14 ... #tag “quoted”") == [
        "Hello",
        "world",
        "Don't",
        "stop",
        "yes",
        "3.14",
        "tag",
        "quoted",
    ]


def test_punctuation_only_tokens_are_not_words():
    assert words("... -- !!! ,") == []
    assert words("") == []


def test_chinese_each_character_is_a_word_and_latin_runs_are_one():
    assert words("在 Python 3.11 中使用numpy，计算「矩阵」。", "zh") == [
        "在",
        "Python",
        "3.11",
        "中",
        "使",
        "用",
        "numpy",
        "计",
        "算",
        "矩",
        "阵",
    ]


def test_fullwidth_punctuation_splits_latin_runs_in_cjk_text():
    assert words("版本一，hello，world。", "zh") == ["版", "本", "一", "hello", "world"]


def test_japanese_kana_are_words():
    assert words("これはペンです。", "ja") == ["こ", "れ", "は", "ペ", "ン", "で", "す"]


def test_lang_decides_the_split_when_given():
    text = "数据质量决定模型上限"
    assert words(text, "en") == [text]
    assert len(words(text, "zh-Hans")) == len(text)
    assert base_lang("zh_CN") == "zh" and base_lang(None) is None


def test_autodetect_mostly_cjk():
    assert is_cjk("我们用 Python 清洗数据，然后训练模型。")
    # English with a short Chinese quote stays space-delimited.
    english = "The proverb 学而时习之 is often quoted at the start of textbooks about learning and practice."
    assert not is_cjk(english)
    assert "学而时习之" in words(english)
    # An exact tie is not "mostly".
    assert not is_cjk("hello world 你好")


def test_korean_is_space_delimited():
    assert words("안녕하세요 세계", "ko") == ["안녕하세요", "세계"]
    assert not is_cjk("안녕하세요 세계")


def test_lines_and_paragraphs():
    text = "  first line \n\nsecond\n   \n\n third \nfourth"
    assert lines(text) == ["first line", "second", "third", "fourth"]
    assert paragraphs(text) == ["first line", "second", "third \nfourth"]


def test_english_sentences():
    text = 'He said "Hi." Then he left! Pi is 3.14 here. Really? Yes'
    assert sentences(text) == ['He said "Hi."', "Then he left!", "Pi is 3.14 here.", "Really?", "Yes"]


def test_chinese_sentences_need_no_space_and_keep_closing_quotes():
    text = "你好。我是谁？“走吧！”他说。好的.然后呢"
    assert sentences(text, "zh") == ["你好。", "我是谁？", "“走吧！”", "他说。", "好的.", "然后呢"]
    # In English text a half-width period before Han is not a boundary.
    assert len(sentences("See the word.中 in the list and more English words here.", "en")) == 1


def test_ngrams():
    assert ngrams(["a", "b", "c", "d"], 2) == [("a", "b"), ("b", "c"), ("c", "d")]
    assert ngrams(["a"], 2) == []
    with pytest.raises(ValueError, match="at least 1"):
        ngrams(["a"], 0)


def test_stop_words_are_gophers_list_and_language_guess():
    assert STOP_WORDS["en"] == {"the", "be", "to", "of", "and", "that", "have", "with"}
    assert len(STOP_WORDS["zh"]) == 8 and all(len(w) == 1 for w in STOP_WORDS["zh"])
    assert stop_word_lang("plain english", None) == "en"
    assert stop_word_lang("这是中文的句子。", None) == "zh"
    assert stop_word_lang("これは日本語の文です。", None) == "ja"
    assert stop_word_lang("Ein deutscher Satz.", "de") is None


def test_real_english_docs_word_counts_track_whitespace_tokens():
    from pydoc_data.topics import topics

    for name in ("assignment", "if", "typesseq"):
        text = topics[name]
        n_tokens = len(text.split())
        # Only punctuation-only tokens (">>>", "::", "...") are dropped.
        assert 0.8 * n_tokens <= len(words(text)) <= n_tokens
        assert not is_cjk(text)


@pytest.mark.skipif(not ZH_FORTUNES.exists(), reason="Debian fortunes-zh not installed")
def test_real_chinese_text_is_detected_and_split_by_character():
    records = [r for r in ZH_FORTUNES.read_text(encoding="utf-8").split("\n%\n") if r.strip()][:300]
    assert len(records) == 300
    detected = sum(is_cjk(r) for r in records)
    assert detected >= 0.9 * len(records)
    for record in records:
        if is_cjk(record):
            # Every Han character became its own word, so there are many more words than tokens.
            n_han = sum("\u4e00" <= c <= "\u9fff" for c in record)
            assert len(words(record)) >= n_han
