import pickle
from pathlib import Path

import pytest

from kiln.data.steps.base import STEPS, build_step
from kiln.data.steps.toxicity import (
    IGNORED_BY_DEFAULT,
    Toxicity,
    WordList,
    builtin_word_list,
    read_word_list,
    toxicity_score,
)
from kiln.errors import ConfigError

pytest.importorskip("better_profanity")


def doc(text: str, lang: str | None = None, doc_id: str = "d") -> dict:
    return {"id": doc_id, "text": text, "source": "test", "meta": {"lang": lang} if lang else {}}


def fake_classifier(text: str) -> float:
    """A stand-in trained classifier: the share of the word "awful"."""
    tokens = text.lower().split()
    return tokens.count("awful") / len(tokens) if tokens else 0.0


def bad_classifier(text: str) -> float:
    return 2.0


CLEAN_99 = " ".join(["plain"] * 99)


def test_registered_and_built_by_name():
    assert STEPS["toxicity"] is Toxicity
    step = build_step("toxicity", {"max_score": 0.05}, "data.params.toxicity")
    assert step.max_score == 0.05 and step.builtin_list


def test_builtin_list_ships_in_the_wheel():
    entries = builtin_word_list()
    assert len(entries) > 800
    assert all(w in {e.lower() for e in entries} for w in IGNORED_BY_DEFAULT)  # no stale ignore entries


def test_score_counts_words_and_phrases():
    wl = WordList(["shit", "blow job", "sh!t"])
    assert toxicity_score("This is shit.", wl) == pytest.approx(1 / 3)
    assert toxicity_score("a blow job here", wl) == pytest.approx(2 / 4)  # both words of the phrase
    assert toxicity_score("a blow to the job", wl) == 0.0  # not adjacent: no match
    assert toxicity_score("SHIT and Sh!t", wl) == pytest.approx(2 / 3)  # case-insensitive, leetspeak entry
    assert toxicity_score("shitake mushrooms", wl) == 0.0  # whole words only
    assert toxicity_score("", wl) == 0.0


def test_max_score_both_sides():
    step = Toxicity()
    # 1 flagged word in 100 is exactly 0.01: kept (drop only above); 2 in 100 is dropped.
    one = doc("fuck " + " ".join(["plain"] * 99))
    two = doc("fuck fuck " + " ".join(["plain"] * 98))
    assert step.reason(one) is None and one["meta"]["toxicity"] == pytest.approx(0.01)
    assert step.reason(two) == "toxic" and two["meta"]["toxicity"] == pytest.approx(0.02)
    clean = doc(CLEAN_99)
    assert step.reason(clean) is None and clean["meta"]["toxicity"] == 0.0
    assert step.stats.counters["flagged_docs"] == 2


def test_ignore_words_default_and_override():
    text = "The harbour master said the seamen would kill time at the sandbar until the tide turned."
    assert Toxicity().reason(doc(text)) is None
    strict = Toxicity(ignore_words=[])
    assert strict.reason(doc(text)) == "toxic"


def test_real_text_is_clean():
    """Python's reference documentation (not written here) scores 0 everywhere."""
    topics = pytest.importorskip("pydoc_data.topics").topics
    step = Toxicity()
    scores = []
    for name, text in topics.items():
        d = doc(text, "en", name)
        assert step.reason(d) is None
        scores.append(d["meta"]["toxicity"])
    assert max(scores) == 0.0


def test_user_list_file_chinese(tmp_path):
    path = tmp_path / "zh.txt"
    path.write_text("# 用户提供的词表\n傻逼\n\n王八蛋  # 注释\n", encoding="utf-8")
    assert read_word_list(path) == ["傻逼", "王八蛋"]
    step = Toxicity(builtin_list=False, word_list_files=[str(path)], max_score=0.1)
    step.validate()
    toxic = doc("你这个傻逼王八蛋。", "zh")  # 5 of 8 character-words flagged
    assert step.reason(toxic) == "toxic" and toxic["meta"]["toxicity"] == pytest.approx(5 / 8)
    # One two-character hit among 20+ characters is under 0.1: kept. "傻" alone is not an entry.
    mild = doc("今天天气很好，我们去公园散步，他说傻逼这个词不好。", "zh")
    assert step.reason(mild) is None and 0 < mild["meta"]["toxicity"] <= 0.1
    assert step.reason(doc("他很傻。", "zh")) is None


def test_classifier_hook_alongside_and_instead():
    spec = f"{__name__}:fake_classifier"
    alongside = Toxicity(classifier=spec, max_classifier_score=0.2)
    alongside.validate()
    assert alongside.reason(doc("awful awful weather today")) == "toxic_classifier"  # 0.5 > 0.2
    ok = doc("awful weather today and tomorrow too")  # 1/6 <= 0.2
    assert alongside.reason(ok) is None
    assert ok["meta"] == {"toxicity": 0.0, "toxicity_classifier": pytest.approx(1 / 6, abs=1e-6)}
    # The list still decides first when both are on.
    assert alongside.reason(doc("fuck fuck")) == "toxic"
    instead = Toxicity(builtin_list=False, classifier=spec, max_classifier_score=0.2)
    d = doc("fuck fuck fuck fuck")
    assert instead.reason(d) is None and "toxicity" not in d["meta"]


def test_classifier_out_of_range_is_an_error():
    step = Toxicity(classifier=f"{__name__}:bad_classifier")
    with pytest.raises(ValueError, match="must return a score in"):
        step.reason(doc("anything"))


def test_pickles_before_and_after_setup():
    step = Toxicity(classifier=f"{__name__}:fake_classifier")
    step.setup()
    clone = pickle.loads(pickle.dumps(step))
    assert clone.reason(doc("fuck fuck")) == "toxic"


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_score": 1.5}, "max_score"),
        ({"max_classifier_score": -0.1}, "max_classifier_score"),
        ({"builtin_list": False}, "builtin_list"),
        ({"word_list_files": ["/no/such/list.txt"]}, "word_list_files[0]"),
        ({"classifier": "no_colon"}, "classifier"),
        ({"classifier": "kiln.nowhere:f"}, "classifier"),
    ],
)
def test_validate(kwargs, field):
    with pytest.raises(ConfigError) as err:
        Toxicity(**kwargs).validate()
    assert err.value.key == field


def test_unreadable_list_file_names_it(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"caf\xe9\n")
    with pytest.raises(ConfigError, match="latin1.txt"):
        read_word_list(Path(path))
