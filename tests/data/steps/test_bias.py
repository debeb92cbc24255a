import json
import pickle

import pytest

from kiln.data.config import CurateConfig
from kiln.data.curate import curate
from kiln.data.funnel import funnel_text
from kiln.data.steps.base import STEPS, build_step
from kiln.data.steps.bias import GROUPS, Bias, bias_rates, group_hits
from kiln.data.steps.toxicity import WordList
from kiln.errors import ConfigError

FILLER = "the report describes the weather in the valley during a long quiet week".split()


def doc(text: str, source: str = "web", doc_id: str = "d") -> dict:
    return {"id": doc_id, "text": text, "source": source, "meta": {}}


def padded(sentence: str, words: int) -> str:
    """`sentence` followed by neutral filler up to `words` words."""
    out = sentence.split()
    while len(out) < words:
        out.append(FILLER[len(out) % len(FILLER)])
    return " ".join(out)


def hits(text: str, window: int = 10) -> dict:
    step = Bias(window=window)
    step.setup()
    return group_hits(text.split(), step._groups, step._negative, window)


def test_registered_and_built_by_name():
    assert STEPS["bias"] is Bias
    step = build_step("bias", {"window": 4, "max_hits": 0, "groups": ["religion"]}, "data.params.bias")
    assert (step.window, step.max_hits, step.groups) == (4, 0, ["religion"])


def test_planted_hits_counted_per_group_exactly():
    text = "muslims are violent and jews are greedy while women are hysterical ; the deaf team won"
    assert hits(text) == {"religion": 2, "gender": 1, "disability": 1}  # "deaf" is 3 words from "hysterical"
    text = text.replace("; the", "; " + " ".join(FILLER) + " the")
    assert hits(text) == {"religion": 2, "gender": 1}
    assert hits("the christian charity helped disabled children and refugees") == {}


def test_window_boundary():
    # "muslims" at 0; the negative word after k filler words is k + 1 words away.
    def at(distance: int) -> str:
        return " ".join(["muslims"] + ["x"] * (distance - 1) + ["violent"])

    assert hits(at(5), window=5) == {"religion": 1}
    assert hits(at(6), window=5) == {}
    assert hits(" ".join(["violent"] + ["x"] * 4 + ["muslims"]), window=5) == {"religion": 1}  # before, too
    assert hits(" ".join(["violent"] + ["x"] * 5 + ["muslims"]), window=5) == {}


def test_phrases_measure_distance_from_their_nearest_end():
    groups = {"g": WordList(["ice cream fans"])}
    negative = WordList(["truly awful"])
    text = "ice cream fans are truly awful".split()  # "fans" -> "truly": 2 words
    assert group_hits(text, groups, negative, 2) == {"g": 1}
    assert group_hits(text, groups, negative, 1) == {}
    # With a two-word entry in the list, a one-word one just outside the window stays outside.
    mixed = WordList(["truly awful", "bad"])
    fans = {"g": WordList(["fans"])}
    assert group_hits("truly awful y y y y y bad x x fans".split(), fans, mixed, 2) == {}
    assert group_hits("truly awful y y y y y bad x fans".split(), fans, mixed, 2) == {"g": 1}


def test_thresholds_drop_above_both_and_keep_at_them():
    step = Bias(max_hits=1, max_rate=2.0)
    two = "immigrants are criminals . immigrants are thieves"  # 2 nationality hits in 7 words
    assert step.reason(doc(two)) == "bias_nationality"
    one = doc(padded("immigrants are criminals", 20))
    assert step.reason(one) is None and one["meta"]["bias"] == {"nationality": {"hits": 1, "rate": 50.0}}
    # 2 hits in 1000 words: rate exactly 2.0, not above max_rate: kept; in 999 words: dropped.
    sentence = "immigrants are criminals and immigrants are thieves"
    assert step.reason(doc(padded(sentence, 1000))) is None
    assert step.reason(doc(padded(sentence, 999))) == "bias_nationality"
    assert Bias(max_hits=2, max_rate=0).reason(doc(two)) is None  # 2 hits, not above 2


def test_groups_selectable_and_custom_lists(tmp_path):
    text = "muslims are violent and women are hysterical"
    assert Bias(groups=["gender"], max_hits=0).reason(doc(text)) == "bias_gender"
    only_religion = doc(text)
    assert Bias(groups=["religion"], max_hits=0).reason(only_religion) == "bias_religion"
    assert set(only_religion["meta"]["bias"]) == {"religion"}

    fans = tmp_path / "fans.txt"
    fans.write_text("# supporters of a club\nrovers fans\n")
    neg = tmp_path / "neg.txt"
    neg.write_text("noisy\n")
    step = Bias(identity_files={"fans": str(fans)}, negative_files=[str(neg)], max_hits=0, max_rate=0)
    step.validate()
    assert step.reason(doc("rovers fans are noisy")) == "bias_fans"
    assert step.reason(doc("muslims are violent")) is None  # the built-in negative list was replaced


@pytest.mark.parametrize(
    "params, message",
    [
        ({"groups": ["politics"]}, "data.params.bias.groups[0]: unknown group 'politics'; known: " + ", ".join(GROUPS)),
        ({"window": -1}, "data.params.bias.window: must be >= 0"),
        ({"max_rate": -1}, "data.params.bias.max_rate: must be a finite number >= 0"),
        ({"identity_files": {"x": "/nonexistent"}}, "data.params.bias.identity_files.x: no such file"),
        ({"negative_files": ["/nonexistent"]}, "data.params.bias.negative_files[0]: no such file"),
        ({"max_hit": 1}, "data.params.bias.max_hit: unknown key"),
    ],
)
def test_bad_params_refused_by_name(params, message):
    with pytest.raises(ConfigError) as err:
        build_step("bias", params, "data.params.bias")
    assert str(err.value).startswith(message)


def test_pickles_without_its_lists():
    step = Bias()
    step.reason(doc("hello"))
    clone = pickle.loads(pickle.dumps(step))
    assert clone.reason(doc("muslims are violent . muslims are evil")) == "bias_religion"


def test_pipeline_quarantines_and_reports_rates_per_source(tmp_path):
    bad = "immigrants are criminals and immigrants are thieves"
    forum = [padded(bad, 30)] * 3 + [padded("immigrants are criminals", 30)] + [padded("", 30)] * 6
    news = [padded("", 50)] * 4
    for name, texts in (("forum", forum), ("news", news)):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"id": f"{name}-{i}", "text": t + f" n{i}"}) + "\n" for i, t in enumerate(texts))
        )
    cfg = CurateConfig(inputs=[str(tmp_path / "forum.jsonl"), str(tmp_path / "news.jsonl")], steps=["bias"], tasks=2)
    cfg.validate()
    logged = []
    stats = curate(cfg, tmp_path / "out", log=logged.append)
    assert stats["docs_out"] == 11
    rejected = [json.loads(line) for p in (tmp_path / "out" / "rejected").glob("*.jsonl") for line in p.open()]
    assert sorted(r["doc"]["id"] for r in rejected) == ["forum-0", "forum-1", "forum-2"]
    assert {r["reason"] for r in rejected} == {"bias_nationality"}
    assert all(r["doc"]["meta"]["bias"]["nationality"]["hits"] == 2 for r in rejected)
    on_disk = json.loads((tmp_path / "out" / "stats.json").read_text())
    row = next(s for s in on_disk["steps"] if s["name"] == "bias")
    rates = row["rates"]
    assert rates == bias_rates(row)
    assert rates["forum"]["docs"] == 10 and rates["forum"]["removed"] == 3 and rates["forum"]["words"] == 310
    assert rates["forum"]["groups"]["nationality"] == {
        "docs_with_hits": 4,
        "hits": 7,
        "docs_share": 0.4,
        "hits_per_1000_words": round(7000 / 310, 4),
    }
    assert rates["news"] == {"docs": 4, "words": 204, "removed": 0, "groups": {}}
    assert "forum: 10 docs, 3 removed; nationality 4 (40.00%)" in funnel_text(on_disk)
    assert any("news: 4 docs, 0 removed; no hits" in line for line in logged)
