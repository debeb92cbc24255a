import pickle

import pytest

pytest.importorskip("py3langid")

from kiln.data.steps.langid import LangId  # noqa: E402
from kiln.errors import ConfigError  # noqa: E402

# Written for this test: plain modern Chinese prose.
CHINESE = [
    "今天天气很好，我们一起去公园散步，顺便看看湖边新开的花。",
    "这个程序读取文本文件，统计每个词出现的次数，然后把结果写入一个新的文件。",
    "他在北京的一所大学学习计算机科学，毕业以后打算回家乡当老师。",
]


@pytest.fixture(scope="module")
def loaded():
    step = LangId()
    step.setup()
    return step._identifier


def make_step(loaded, **kw):
    step = LangId(**kw)
    step.validate()
    step._identifier = loaded  # load the model once for the whole file
    return step


def doc(text):
    return {"id": "d", "text": text, "source": "s", "meta": {}}


def english_docs():
    # Real English text nobody here wrote: Python's reference documentation.
    from pydoc_data.topics import topics

    return [doc(text) for _, text in sorted(topics.items())[:30]]


def test_english_and_chinese_identified(loaded):
    step = make_step(loaded)
    for d in english_docs():
        assert step.reason(d) is None
        assert d["meta"]["lang"] == "en" and d["meta"]["lang_score"] > 0.9
    for text in CHINESE:
        d = doc(text)
        assert step.reason(d) is None
        assert d["meta"]["lang"] == "zh" and d["meta"]["lang_score"] > 0.5
    assert step.stats.counters == {"lang_en": 30, "lang_zh": 3}


def test_languages_allow_list(loaded):
    step = make_step(loaded, languages=["zh"])
    assert step.reason(doc(CHINESE[0])) is None
    d = english_docs()[0]
    assert step.reason(d) == "lang_not_allowed" and d["meta"]["lang"] == "en"


def test_min_score_both_sides(loaded):
    d = doc(CHINESE[1])
    score = make_step(loaded).identify(d["text"])[1]
    below, above = max(score - 0.01, 0.0), min(score + 0.01, 1.0)
    assert make_step(loaded, min_score=below).reason(doc(CHINESE[1])) is None
    assert make_step(loaded, min_score=above).reason(doc(CHINESE[1])) == "lang_low_confidence"


def test_per_language_threshold_both_sides(loaded):
    base = make_step(loaded)
    zh_score = base.identify(CHINESE[2])[1]
    # A short English passage (whole topics score 1.0): the start of real documentation.
    en_text = english_docs()[1]["text"][:80]
    en_score = base.identify(en_text)[1]
    assert zh_score < 0.99 and en_score < 0.99
    # A strict threshold for Chinese only: Chinese just below it drops, English keeps min_score.
    strict = make_step(loaded, min_score=0.5, thresholds={"zh": zh_score + 0.01})
    assert strict.reason(doc(CHINESE[2])) == "lang_low_confidence"
    assert strict.reason(doc(en_text)) is None
    # A loose threshold for Chinese only under a strict global one: Chinese stays, English drops.
    loose = make_step(loaded, min_score=en_score + 0.005, thresholds={"zh": zh_score - 0.01})
    assert loose.reason(doc(CHINESE[2])) is None
    assert loose.reason(doc(en_text)) == "lang_low_confidence"
    assert make_step(loaded, min_score=en_score - 0.005).reason(doc(en_text)) is None


def test_short_noise_has_low_confidence(loaded):
    d = doc("12345 678")
    assert make_step(loaded).reason(d) == "lang_low_confidence"
    assert d["meta"]["lang_score"] < 0.5


def test_validate():
    with pytest.raises(ConfigError, match="min_score"):
        LangId(min_score=1.5).validate()
    with pytest.raises(ConfigError, match="languages"):
        LangId(languages=["English"]).validate()
    with pytest.raises(ConfigError, match="thresholds.zh"):
        LangId(thresholds={"zh": -0.1}).validate()
    with pytest.raises(ConfigError, match="does not know"):
        LangId(languages=["en", "qq"]).setup()


def test_pickles_without_model(loaded):
    step = make_step(loaded, languages=["en"])
    copy = pickle.loads(pickle.dumps(step))
    assert copy.languages == ["en"] and not hasattr(copy, "_identifier")
    copy.setup()
    assert copy.reason(english_docs()[0]) is None


FORTUNES_ZH = "/usr/share/games/fortunes/chinese"  # Debian package fortunes-zh


def test_debian_chinese_fortunes(loaded):
    # Real Chinese text nobody here wrote; the file colours its attributions with ANSI escapes.
    import os
    import re

    if not os.path.exists(FORTUNES_ZH):
        pytest.skip("Debian fortunes-zh is not installed (apt-get install fortunes-zh)")
    with open(FORTUNES_ZH, encoding="utf-8") as f:
        raw = re.sub(r"\x1b\[[0-9;]*m", "", f.read())
    records = [r for r in raw.split("\n%\n") if len(re.findall(r"[\u4e00-\u9fff]", r)) >= 30][:300]
    assert len(records) >= 100
    step = make_step(loaded, languages=["zh"])
    kept = sum(step.reason(doc(r)) is None for r in records)
    assert kept >= 0.95 * len(records), f"{kept}/{len(records)} kept as Chinese"
