"""Identify each document's language and keep the languages a recipe asks for.

The model is py3langid's (a naive Bayes classifier over byte n-grams, 140 labels, BSD-3), stored
inside its PyPI wheel, so identification works offline and gives the same answer on every machine.
Scores are py3langid's normalised probabilities (`norm_probs=True`), in [0, 1]. They are comparable
with fastText's in meaning, not in value, so thresholds tuned for fastText lid.176 (FineWeb keeps
English at >= 0.65) are a starting point here, not an equivalent.

`meta["lang"]` is an ISO 639-1 code ("en", "zh", ...) and `meta["lang_score"]` its probability;
later steps (word splitting for Chinese, per-language stop words) read `meta["lang"]`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kiln.data.steps.base import Filter, register
from kiln.errors import ConfigError

LANG_CODE = re.compile(r"^[a-z]{2,3}$")


def load_identifier():
    """py3langid's bundled model, with probabilities normalised to [0, 1] (about 0.8 s to load)."""
    try:
        from py3langid.langid import MODEL_FILE, LanguageIdentifier
    except ImportError:
        raise ConfigError("langid", "needs the `py3langid` package (pip install py3langid)") from None
    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


@register
@dataclass
class LangId(Filter):
    """Set meta lang/lang_score; drop documents in other languages or identified with low confidence.

    A document is dropped with `lang_not_allowed` when `languages` is non-empty and its language is
    not listed, else with `lang_low_confidence` when its score is below `thresholds[lang]` (or
    `min_score` for languages without their own threshold). `min_score = 0` keeps every language
    however uncertain.
    """

    name = "langid"
    languages: list[str] = field(default_factory=list)  # empty: keep every language
    min_score: float = 0.5  # Dolma's fastText English cut-off
    thresholds: dict[str, float] = field(default_factory=dict)  # per-language overrides of min_score

    def validate(self) -> None:
        if not 0.0 <= self.min_score <= 1.0:
            raise ConfigError("min_score", f"must be in [0, 1], got {self.min_score}")
        for code in self.languages:
            if not LANG_CODE.match(code):
                raise ConfigError("languages", f"{code!r} is not an ISO 639 code like 'en' or 'zh'")
        for code, value in self.thresholds.items():
            if not LANG_CODE.match(code):
                raise ConfigError(f"thresholds.{code}", "not an ISO 639 code like 'en' or 'zh'")
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"thresholds.{code}", f"must be in [0, 1], got {value}")

    def setup(self) -> None:
        self._identifier = load_identifier()
        known = set(self._identifier.labels)
        for key, codes in (("languages", self.languages), ("thresholds", list(self.thresholds))):
            unknown = sorted(set(codes) - known)
            if unknown:
                raise ConfigError(
                    key, f"the language model does not know {', '.join(unknown)}; known: {', '.join(sorted(known))}"
                )

    def __getstate__(self) -> dict:
        # The model is ~30 MB of arrays: workers load their own in setup() instead of receiving a copy.
        state = self.__dict__.copy()
        state.pop("_identifier", None)
        return state

    def identify(self, text: str) -> tuple[str, float]:
        if getattr(self, "_identifier", None) is None:
            self.setup()
        lang, score = self._identifier.classify(text)
        return lang, float(score)

    def reason(self, doc: dict) -> str | None:
        lang, score = self.identify(doc["text"])
        doc["meta"]["lang"] = lang
        doc["meta"]["lang_score"] = round(score, 4)
        self.stats.count(f"lang_{lang}")
        if self.languages and lang not in self.languages:
            return "lang_not_allowed"
        if score < self.thresholds.get(lang, self.min_score):
            return "lang_low_confidence"
        return None
