"""Bias filter (`bias`): identity terms co-occurring with negative attribute terms, per group.

Method. The document's words (`kiln.data.steps.text.words`, lowercased) are searched for the
identity terms of each group and for the negative attribute terms. An identity-term occurrence is a
*hit* for its group when a negative term lies within `window` words of it (adjacent words are 1
apart; the distance is counted between the nearest ends of the two terms). A group's *rate* is its
hits per 1000 words of the document. A document is dropped, with reason `bias_<group>`, when for
some selected group both hits > `max_hits` and rate > `max_rate`; the hits threshold spares a
passing phrase, the rate threshold spares a long article that quotes one. Every group's hits and
rate go to `meta.bias` (groups with hits only), and the step counts per source: documents, words,
documents with hits and hits per group, and removals (`bias_rates` turns them into rates).

What this measures is lexical co-occurrence and nothing more: it cannot see sarcasm, implicit or
coded bias, or stereotypes stated without a listed negative word, and it flags counter-speech
("it is wrong to call immigrants criminals") and news reporting of hate the same as hate itself.

Lists. GROUPS and NEGATIVE below, written for this step (English). Words with a common unrelated
sense are left out on purpose ("man" of man pages, the colours "black" and "white", "polish",
"roma"), at the cost of missing those identities; `identity_files` and `negative_files` replace
or add lists (one term per line, `#` comments, phrases allowed, any language the word splitter
handles).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from pathlib import Path

from kiln.data.steps.base import Filter, register
from kiln.data.steps.text import words
from kiln.data.steps.toxicity import WordList, read_word_list
from kiln.errors import ConfigError

GROUPS: dict[str, list[str]] = {
    "gender": "woman women girl girls female females lady ladies men boys male males transgender".split(),
    "sexual_orientation": (
        "gay gays lesbian lesbians bisexual bisexuals homosexual homosexuals queer queers lgbt lgbtq "
        "heterosexual heterosexuals asexual"
    ).split(),
    "religion": (
        "muslim muslims islam islamic christian christians christianity jew jews jewish judaism hindu hindus "
        "hinduism buddhist buddhists sikh sikhs catholic catholics atheist atheists mormon mormons"
    ).split(),
    "ethnicity": (
        "african africans asian asians hispanic hispanics latino latinos latina latinas arab arabs "
        "indigenous aboriginal caucasian caucasians gypsies"
    ).split(),
    "nationality": (
        "american americans mexican mexicans chinese russian russians indian indians japanese german germans "
        "french british irish italian italians iranian iranians pakistani pakistanis nigerian nigerians "
        "syrian syrians immigrant immigrants refugee refugees foreigner foreigners"
    ).split(),
    "disability": (
        "disabled disability disabilities handicapped blind deaf autistic autism wheelchair paralyzed "
        "paraplegic amputee schizophrenic dyslexic"
    ).split(),
}

NEGATIVE: list[str] = (
    "stupid dumb lazy dirty filthy violent dangerous criminal criminals evil inferior disgusting terrorist "
    "terrorists savage savages ignorant worthless greedy primitive backward subhuman vermin parasite "
    "parasites thief thieves liar liars cheats weak hysterical incompetent ugly crazy deviant deviants "
    "perverted perverts unnatural useless pathetic cowardly untrustworthy barbaric barbarians idiot idiots "
    "moron morons illegals animals scum trash diseased plague infest invaders hateful abomination "
    "degenerate degenerates retarded freak freaks uncivilized fanatic fanatics extremist extremists "
    "rapists thugs"
).split()


def group_hits(doc_words: list[str], groups: dict[str, WordList], negative: WordList, window: int) -> dict[str, int]:
    """Per group: identity-term occurrences with a negative term within `window` words."""
    lowered = [w.lower() for w in doc_words]
    neg = negative.spans(lowered)
    if not neg:
        return {}
    starts = [s for s, _ in neg]
    longest = max(n for _, n in neg)
    hits: dict[str, int] = {}
    for name, terms in groups.items():
        count = 0
        for start, n in terms.spans(lowered):
            end = start + n - 1
            # Negative spans starting in [start - window - longest + 1, end + window] may be near.
            lo = bisect.bisect_left(starts, start - window - longest + 1)
            hi = bisect.bisect_right(starts, end + window)
            if any(max(ns - end, start - (ns + nn - 1)) <= window for ns, nn in neg[lo:hi]):
                count += 1
        if count:
            hits[name] = count
    return hits


@register
@dataclass
class Bias(Filter):
    """Drops documents where a group's identity terms keep company with negative terms (module docstring)."""

    name = "bias"
    window: int = 10  # words; about a clause, so "X are Y" and "Y X" both count
    max_hits: int = 1  # drop only above this many hits for one group ...
    max_rate: float = 2.0  # ... and above this many hits per 1000 words
    groups: list[str] = field(default_factory=list)  # empty: every built-in and file group
    identity_files: dict[str, str] = field(default_factory=dict)  # group -> file; replaces or adds a group
    negative_files: list[str] = field(default_factory=list)  # replace the built-in negative list

    def validate(self) -> None:
        if self.window < 0:
            raise ConfigError("window", f"must be >= 0, got {self.window}")
        if self.max_hits < 0:
            raise ConfigError("max_hits", f"must be >= 0, got {self.max_hits}")
        if not 0 <= self.max_rate < math.inf:  # also refuses nan, which every comparison would pass
            raise ConfigError("max_rate", f"must be a finite number >= 0, got {self.max_rate}")
        for group, path in self.identity_files.items():
            if not Path(path).is_file():
                raise ConfigError(f"identity_files.{group}", f"no such file: {path}")
        for i, path in enumerate(self.negative_files):
            if not Path(path).is_file():
                raise ConfigError(f"negative_files[{i}]", f"no such file: {path}")
        known = list(GROUPS) + [g for g in self.identity_files if g not in GROUPS]
        for i, group in enumerate(self.groups):
            if group not in known:
                raise ConfigError(f"groups[{i}]", f"unknown group {group!r}; known: {', '.join(known)}")

    def setup(self) -> None:
        if getattr(self, "_ready", False):
            return
        terms = {**GROUPS, **{g: read_word_list(Path(p)) for g, p in self.identity_files.items()}}
        selected = self.groups or list(terms)
        self._groups = {g: WordList(terms[g]) for g in selected}
        negative = NEGATIVE
        if self.negative_files:
            negative = [t for path in self.negative_files for t in read_word_list(Path(path))]
        self._negative = WordList(negative)
        self._ready = True

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("_ready", "_groups", "_negative"):
            state.pop(key, None)
        return state

    def reason(self, doc: dict) -> str | None:
        self.setup()
        doc_words = words(doc["text"], doc["meta"].get("lang"))
        source = doc["source"]
        self.stats.count(f"docs:{source}")
        self.stats.count(f"words:{source}", len(doc_words))
        hits = group_hits(doc_words, self._groups, self._negative, self.window)
        if not hits:
            return None
        per_k = 1000 / max(len(doc_words), 1)
        doc["meta"]["bias"] = {g: {"hits": h, "rate": round(h * per_k, 3)} for g, h in hits.items()}
        for group, h in hits.items():
            self.stats.count(f"docs_with_hits:{source}:{group}")
            self.stats.count(f"hits:{source}:{group}", h)
        over = [(h, g) for g, h in hits.items() if h > self.max_hits and h * per_k > self.max_rate]
        if not over:
            return None
        self.stats.count(f"removed:{source}")
        return f"bias_{max(over)[1]}"


def bias_rates(step: dict) -> dict[str, dict]:
    """Per source, from a `bias` row of stats.json: documents, words, removals, and per group the
    share of documents with hits and the hits per 1000 words."""
    counters = step["counters"]
    out: dict[str, dict] = {}
    for key, value in counters.items():
        kind, _, rest = key.partition(":")
        if kind == "docs" and rest:
            words_n = counters.get(f"words:{rest}", 0)
            out[rest] = {"docs": value, "words": words_n, "removed": counters.get(f"removed:{rest}", 0), "groups": {}}
    for key, value in counters.items():
        kind, _, rest = key.partition(":")
        if kind in ("hits", "docs_with_hits"):
            source, _, group = rest.rpartition(":")
            if source in out:
                entry = out[source]["groups"].setdefault(group, {"docs_with_hits": 0, "hits": 0})
                entry[kind] = value
    for row in out.values():
        for entry in row["groups"].values():
            entry["docs_share"] = round(entry["docs_with_hits"] / max(row["docs"], 1), 6)
            entry["hits_per_1000_words"] = round(1000 * entry["hits"] / max(row["words"], 1), 4)
    return out


def bias_rates_text(stats: dict) -> str:
    """The rates of every `bias` row as lines for the funnel ("" when the pipeline has none)."""
    lines = []
    for step in stats["steps"]:
        if step["name"] != "bias":
            continue
        lines.append("bias by source: docs, removed, then per group docs with hits (share) and hits/1000 words")
        for source, row in sorted(bias_rates(step).items()):
            groups = ", ".join(
                f"{g} {e['docs_with_hits']} ({100 * e['docs_share']:.2f}%) {e['hits_per_1000_words']:.3f}"
                for g, e in sorted(row["groups"].items())
            )
            lines.append(f"  {source}: {row['docs']} docs, {row['removed']} removed; {groups or 'no hits'}")
    return "\n".join(lines)
