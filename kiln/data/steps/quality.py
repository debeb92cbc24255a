"""Heuristic quality filters with the published thresholds: Gopher quality and repetition, C4, FineWeb.

Each rule has a pure statistics function (`gopher_quality_stats`, `gopher_repetition_stats`,
`fineweb_stats`, `C4Quality.clean`) so tests can check the published definitions directly; the
Filter classes compare those statistics with their config. A value exactly at a threshold is kept:
the papers state the condition that removes ("more than 0.1", "fewer than 50").

Words come from kiln.data.steps.text with doc["meta"]["lang"] when the langid step set it, so Chinese
counts each character as a word instead of one word per paragraph. Where the anchors disagree, and
how each rule reads for Chinese, is written in docs/curate.md ("Heuristic filters").
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

from kiln.data.steps.base import Filter, register
from kiln.data.steps.text import (
    STOP_WORDS,
    count_cjk_chars,
    is_cjk,
    lines,
    ngrams,
    paragraphs,
    split_sentences,
    split_words,
    stop_word_lang,
)
from kiln.errors import ConfigError

_HAS_LETTER = re.compile(r"[^\W\d_]")


def _check_fraction(key: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ConfigError(key, f"must be a fraction in [0, 1], got {value}")


def _check_ngram_table(key: str, table: dict[str, float]) -> None:
    for n, value in table.items():
        if not n.isdigit() or int(n) < 1:
            raise ConfigError(f"{key}.{n}", "keys are n-gram sizes (positive integers written as strings)")
        _check_fraction(f"{key}.{n}", value)


# --------------------------------------------------------------------------------------------------
# Gopher quality (Rae et al. 2021, "Scaling Language Models", appendix A.1.1)


def gopher_quality_stats(text: str, lang: str | None = None, bullets: str = "•‣◦⁃●○▪■-*") -> dict:
    """The quantities Gopher's quality filter thresholds.

    words: `text.words`; mean_word_length: characters per word, None for CJK text (a character-word
    has length 1 by construction, so the bound says nothing); hash_ratio and ellipsis_ratio: "#"
    and "..."/"…" occurrences per word; bullet_lines and ellipsis_lines: fractions of non-empty lines
    starting with a bullet / ending in an ellipsis; alpha_words: fraction of words with at least one
    letter (Han characters are letters); stop_words: how many distinct words of the language's
    STOP_WORDS list occur (None when the language has no list).
    """
    cjk = is_cjk(text, lang)
    ws = split_words(text, cjk)
    n = len(ws)
    ls = lines(text)
    sw_lang = stop_word_lang(text, lang)
    return {
        "cjk": cjk,
        "words": n,
        "mean_word_length": None if cjk or n == 0 else sum(map(len, ws)) / n,
        "hash_ratio": text.count("#") / n if n else 0.0,
        "ellipsis_ratio": (text.count("...") + text.count("…")) / n if n else 0.0,
        "bullet_lines": sum(line.startswith(tuple(bullets)) for line in ls) / len(ls) if ls else 0.0,
        "ellipsis_lines": sum(line.endswith(("...", "…")) for line in ls) / len(ls) if ls else 0.0,
        "alpha_words": sum(1 for w in ws if _HAS_LETTER.search(w)) / n if n else 0.0,
        "stop_words": len(STOP_WORDS[sw_lang] & {w.lower() for w in ws}) if sw_lang else None,
    }


@register
@dataclass
class GopherQuality(Filter):
    """Gopher's document-quality rules; each threshold is the paper's value."""

    name = "gopher_quality"
    min_doc_words: int = 50
    max_doc_words: int = 100_000
    min_avg_word_length: float = 3.0
    max_avg_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1  # applied to "#" and to ellipses separately, as in the paper
    max_bullet_lines_ratio: float = 0.9
    max_ellipsis_lines_ratio: float = 0.3
    min_alpha_words_ratio: float = 0.8
    min_stop_words: int = 2
    bullets: str = "•‣◦⁃●○▪■-*"  # a line starting with any of these characters is a bullet line

    def validate(self) -> None:
        if not 0 <= self.min_doc_words <= self.max_doc_words:
            raise ConfigError("min_doc_words", f"must be in [0, max_doc_words={self.max_doc_words}]")
        if not self.max_avg_word_length < math.inf:  # also refuses NaN
            raise ConfigError("max_avg_word_length", f"must be finite, got {self.max_avg_word_length}")
        if not 0 <= self.min_avg_word_length <= self.max_avg_word_length:
            raise ConfigError("min_avg_word_length", f"must be in [0, max_avg_word_length={self.max_avg_word_length}]")
        for key in ("max_bullet_lines_ratio", "max_ellipsis_lines_ratio", "min_alpha_words_ratio"):
            _check_fraction(key, getattr(self, key))
        if not 0 <= self.max_symbol_word_ratio < math.inf:  # also refuses NaN
            raise ConfigError(
                "max_symbol_word_ratio", f"must be a finite number >= 0, got {self.max_symbol_word_ratio}"
            )
        if self.min_stop_words < 0:
            raise ConfigError("min_stop_words", f"must be >= 0, got {self.min_stop_words}")

    def reason(self, doc: dict) -> str | None:
        s = gopher_quality_stats(doc["text"], doc["meta"].get("lang"), self.bullets)
        if s["words"] < self.min_doc_words:
            return "gopher_too_few_words"
        if s["words"] > self.max_doc_words:
            return "gopher_too_many_words"
        if s["mean_word_length"] is None:
            self.stats.count("mean_word_length_skipped_cjk")
        elif s["mean_word_length"] < self.min_avg_word_length:
            return "gopher_short_words"
        elif s["mean_word_length"] > self.max_avg_word_length:
            return "gopher_long_words"
        if s["hash_ratio"] > self.max_symbol_word_ratio:
            return "gopher_hash_ratio"
        if s["ellipsis_ratio"] > self.max_symbol_word_ratio:
            return "gopher_ellipsis_ratio"
        if s["bullet_lines"] > self.max_bullet_lines_ratio:
            return "gopher_bullet_lines"
        if s["ellipsis_lines"] > self.max_ellipsis_lines_ratio:
            return "gopher_ellipsis_lines"
        if s["alpha_words"] < self.min_alpha_words_ratio:
            return "gopher_alpha_words"
        if s["stop_words"] is None:
            self.stats.count("stop_words_skipped_no_list")
        elif s["stop_words"] < self.min_stop_words:
            return "gopher_stop_words"
        return None


# --------------------------------------------------------------------------------------------------
# Gopher repetition (Rae et al. 2021, appendix A.1.1 and table A1)


def duplicate_fractions(items: list[str]) -> tuple[float, float]:
    """(fraction of items that repeat an earlier item, fraction of characters in those repeats).

    The first occurrence of a line is not a duplicate; its later copies are. Characters are summed
    over the items themselves (no separators), so the two fractions share one denominator per kind.
    """
    seen: set[str] = set()
    dup_items = dup_chars = total_chars = 0
    for item in items:
        total_chars += len(item)
        if item in seen:
            dup_items += 1
            dup_chars += len(item)
        else:
            seen.add(item)
    if not items:
        return 0.0, 0.0
    return dup_items / len(items), (dup_chars / total_chars if total_chars else 0.0)


def _covered_chars(lengths: list[int], starts, n: int) -> int:
    """Characters of the words covered by n-grams starting at `starts`, each word counted once."""
    covered = bytearray(len(lengths))
    for i in starts:
        covered[i : i + n] = b"\x01" * n
    return sum(length for length, c in zip(lengths, covered) if c)


def top_ngram_char_fraction(ws: list[str], n: int) -> float:
    """Characters inside occurrences of the most frequent word n-gram / characters of all words.

    An n-gram seen once is not repetition, so the fraction is 0 unless the top count is at least 2.
    Ties go to the n-gram with more characters; overlapping occurrences ("a a a") count each word once.
    """
    grams = ngrams(ws, n)
    if not grams:
        return 0.0
    counts = Counter(grams)
    best = max(counts.values())
    if best < 2:
        return 0.0
    top = max((g for g, c in counts.items() if c == best), key=lambda g: sum(map(len, g)))
    lengths = [len(w) for w in ws]
    return _covered_chars(lengths, (i for i, g in enumerate(grams) if g == top), n) / sum(lengths)


def dup_ngram_char_fraction(ws: list[str], n: int) -> float:
    """Characters inside every occurrence of any word n-gram that occurs more than once / characters
    of all words, "taking care not to count characters that occur in overlapping n-grams more than once"."""
    grams = ngrams(ws, n)
    counts = Counter(grams)
    if not grams or max(counts.values()) < 2:
        return 0.0
    lengths = [len(w) for w in ws]
    return _covered_chars(lengths, (i for i, g in enumerate(grams) if counts[g] > 1), n) / sum(lengths)


def cjk_ngram_size(n: int, scale: float) -> int:
    """Characters in a CJK n-gram standing for a word n-gram: a Chinese word averages about 1.5
    characters, so the paper's word 2-gram is a 3-character gram (2 3 4 -> 3 5 6; 5..10 -> 8..15)."""
    return max(n, int(n * scale + 0.5))


def gopher_repetition_stats(
    text: str, lang: str | None = None, top_ns=(2, 3, 4), dup_ns=(5, 6, 7, 8, 9, 10), cjk_ngram_scale: float = 1.5
) -> dict:
    """All repetition quantities: dup_lines, dup_line_chars, dup_paragraphs, dup_paragraph_chars,
    top_ngram {n: fraction}, dup_ngram {n: fraction} (n as configured; CJK text uses `cjk_ngram_size`)."""
    cjk = is_cjk(text, lang)
    ws = split_words(text, cjk)
    size = (lambda n: cjk_ngram_size(n, cjk_ngram_scale)) if cjk else (lambda n: n)
    s = {}
    s["dup_lines"], s["dup_line_chars"] = duplicate_fractions(lines(text))
    s["dup_paragraphs"], s["dup_paragraph_chars"] = duplicate_fractions(paragraphs(text))
    s["top_ngram"] = {n: top_ngram_char_fraction(ws, size(n)) for n in top_ns}
    s["dup_ngram"] = {n: dup_ngram_char_fraction(ws, size(n)) for n in dup_ns}
    return s


@register
@dataclass
class GopherRepetition(Filter):
    """Gopher's repetition rules (table A1): duplicate lines and paragraphs, repeated n-grams."""

    name = "gopher_repetition"
    max_dup_line_fraction: float = 0.3
    max_dup_paragraph_fraction: float = 0.3
    max_dup_line_char_fraction: float = 0.2
    max_dup_paragraph_char_fraction: float = 0.2
    top_ngram_max_fractions: dict[str, float] = field(default_factory=lambda: {"2": 0.20, "3": 0.18, "4": 0.16})
    dup_ngram_max_fractions: dict[str, float] = field(
        default_factory=lambda: {"5": 0.15, "6": 0.14, "7": 0.13, "8": 0.12, "9": 0.11, "10": 0.10}
    )
    cjk_ngram_scale: float = 1.5  # CJK character-grams are this many times longer than word n-grams

    def validate(self) -> None:
        for key in (
            "max_dup_line_fraction",
            "max_dup_paragraph_fraction",
            "max_dup_line_char_fraction",
            "max_dup_paragraph_char_fraction",
        ):
            _check_fraction(key, getattr(self, key))
        _check_ngram_table("top_ngram_max_fractions", self.top_ngram_max_fractions)
        _check_ngram_table("dup_ngram_max_fractions", self.dup_ngram_max_fractions)
        if not 1 <= self.cjk_ngram_scale < math.inf:  # also refuses NaN
            raise ConfigError("cjk_ngram_scale", f"must be a finite number >= 1, got {self.cjk_ngram_scale}")

    def reason(self, doc: dict) -> str | None:
        text = doc["text"]
        dup_lines, dup_line_chars = duplicate_fractions(lines(text))
        if dup_lines > self.max_dup_line_fraction:
            return "gopher_dup_lines"
        if dup_line_chars > self.max_dup_line_char_fraction:
            return "gopher_dup_line_chars"
        dup_paras, dup_para_chars = duplicate_fractions(paragraphs(text))
        if dup_paras > self.max_dup_paragraph_fraction:
            return "gopher_dup_paragraphs"
        if dup_para_chars > self.max_dup_paragraph_char_fraction:
            return "gopher_dup_paragraph_chars"
        cjk = is_cjk(text, doc["meta"].get("lang"))
        ws = split_words(text, cjk)
        size = (lambda n: cjk_ngram_size(int(n), self.cjk_ngram_scale)) if cjk else int
        for n, limit in sorted(self.top_ngram_max_fractions.items(), key=lambda kv: int(kv[0])):
            if top_ngram_char_fraction(ws, size(n)) > limit:
                return f"gopher_top_{n}gram"
        for n, limit in sorted(self.dup_ngram_max_fractions.items(), key=lambda kv: int(kv[0])):
            fraction = dup_ngram_char_fraction(ws, size(n))
            if fraction > limit:
                return f"gopher_dup_{n}gram"
            if fraction == 0.0:
                break  # no repeated n-gram means no repeated longer n-gram either
        return None


# --------------------------------------------------------------------------------------------------
# C4 (Raffel et al. 2020, section 2.2; line by line as in TFDS c4_utils.clean_page)

C4_POLICY_SUBSTRINGS = [
    "terms of use",
    "privacy policy",
    "cookie policy",
    "uses cookies",
    "use of cookies",
    "use cookies",
]
_CITATION = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]", re.IGNORECASE)


@register
@dataclass
class C4Quality(Filter):
    """C4's page cleaning. Removes lines (no end mark, too few words, a word over max_word_length,
    "javascript", a policy phrase; citation markers within lines) and drops pages ("lorem ipsum",
    "{", fewer than min_sentences sentences left). Kept pages have their text rewritten in place."""

    name = "c4"
    min_words_per_line: int = 5  # TFDS c4_utils; datatrove/FineWeb use 3
    min_sentences: int = 3  # TFDS c4_utils; datatrove/FineWeb use 5
    max_word_length: int = 1000
    filter_no_terminal_punct: bool = True  # FineWeb turns this off (it removed ~30% of tokens)
    end_marks: str = '.?!"。！？”」』'  # TFDS's . ? ! " plus CJK full stops and closing quotes
    remove_citations: bool = True
    filter_lorem_ipsum: bool = True
    filter_javascript: bool = True
    filter_curly_bracket: bool = True
    filter_policy: bool = True
    policy_substrings: list[str] = field(default_factory=lambda: list(C4_POLICY_SUBSTRINGS))
    keep_paragraph_breaks: bool = (
        True  # TFDS joins kept lines with "\n"; this keeps one blank line where the page had one
    )

    def validate(self) -> None:
        for key in ("min_words_per_line", "min_sentences"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")
        if self.max_word_length < 1:
            raise ConfigError("max_word_length", f"must be >= 1, got {self.max_word_length}")
        if self.filter_no_terminal_punct and not self.end_marks:
            raise ConfigError("end_marks", "is empty but filter_no_terminal_punct is true")

    def clean(self, text: str, lang: str | None = None) -> tuple[str, str | None, Counter]:
        """(cleaned text, reason the page is dropped or None, counts of lines removed per rule)."""
        cjk = is_cjk(text, lang)
        end_marks = tuple(self.end_marks)
        counts: Counter = Counter()
        kept: list[str] = []
        n_sentences = 0
        blank_pending = False
        for raw in text.split("\n"):
            line = raw.strip()
            if not line:
                blank_pending = bool(kept)
                continue
            ws = split_words(line, cjk)
            if any(len(w) > self.max_word_length for w in ws):
                counts["lines_long_word"] += 1
                continue
            if self.remove_citations:
                line, n = _CITATION.subn("", line)
                if n:
                    counts["citations_removed"] += n
                    ws = split_words(line, cjk)
            if self.filter_no_terminal_punct and (not line.endswith(end_marks) or line.endswith("...")):
                counts["lines_no_terminal_punct"] += 1
                continue
            if len(ws) < self.min_words_per_line:
                counts["lines_too_few_words"] += 1
                continue
            lower = line.lower()
            if self.filter_lorem_ipsum and "lorem ipsum" in lower:
                return text, "c4_lorem_ipsum", counts
            if self.filter_javascript and "javascript" in lower:
                counts["lines_javascript"] += 1
                continue
            if self.filter_curly_bracket and "{" in line:
                return text, "c4_curly_bracket", counts
            if self.filter_policy and any(p in lower for p in self.policy_substrings):
                counts["lines_policy"] += 1
                continue
            n_sentences += len(split_sentences(line, cjk))
            if blank_pending and self.keep_paragraph_breaks:
                kept.append("")
            blank_pending = False
            kept.append(line)
        if n_sentences < self.min_sentences:
            return text, "c4_too_few_sentences", counts
        return "\n".join(kept), None, counts

    def reason(self, doc: dict) -> str | None:
        text, why, counts = self.clean(doc["text"], doc["meta"].get("lang"))
        for key, n in counts.items():
            if n:
                self.stats.count(key, n)
        if why is None and text != doc["text"]:
            # Only a kept page is rewritten: a dropped one goes to rejected/ as it came in.
            doc["text"] = text
            self.stats.count("docs_edited")
        return why


# --------------------------------------------------------------------------------------------------
# FineWeb (Penedo et al. 2024, section 3.6 "custom filters")


def fineweb_stats(
    text: str,
    lang: str | None = None,
    end_marks: str = ".?!\"'。！？”’」』",
    short_line_length: int = 30,
    cjk_char_width: float = 3.0,
) -> dict:
    """line_punct: fraction of non-empty lines ending in an end mark; short_lines: fraction of lines
    at most `short_line_length` wide (a CJK character counts `cjk_char_width`); dup_line_chars:
    characters in lines repeating an earlier line / characters in all lines; newlines_per_word."""
    ls = lines(text)
    marks = tuple(end_marks)
    n_words = len(split_words(text, is_cjk(text, lang)))
    width_extra = cjk_char_width - 1.0
    short = sum(
        1 for line in ls if len(line) + (width_extra * count_cjk_chars(line) if width_extra else 0) <= short_line_length
    )
    return {
        "line_punct": sum(line.endswith(marks) for line in ls) / len(ls) if ls else 0.0,
        "short_lines": short / len(ls) if ls else 0.0,
        "dup_line_chars": duplicate_fractions(ls)[1],
        "newlines_per_word": text.count("\n") / n_words if n_words else 0.0,
    }


@register
@dataclass
class FineWebQuality(Filter):
    """FineWeb's three custom filters; the optional fourth is datatrove's newline-per-word rule."""

    name = "fineweb"
    min_line_punct_ratio: float = 0.12
    end_marks: str = ".?!\"'。！？”’」』"
    max_short_line_ratio: float = 0.67
    short_line_length: int = 30
    cjk_char_width: float = 3.0  # a Han/kana/hangul character is ~3 Latin characters of content
    max_dup_line_char_ratio: float = 0.1  # the FineWeb paper's value; datatrove's code default is 0.01
    max_newline_word_ratio: float | None = None  # datatrove's FineWebQualityFilter uses 0.3; off here as in the paper

    def validate(self) -> None:
        for key in ("min_line_punct_ratio", "max_short_line_ratio", "max_dup_line_char_ratio"):
            _check_fraction(key, getattr(self, key))
        if self.short_line_length < 0:
            raise ConfigError("short_line_length", f"must be >= 0, got {self.short_line_length}")
        if not 1 <= self.cjk_char_width < math.inf:  # also refuses NaN
            raise ConfigError("cjk_char_width", f"must be a finite number >= 1, got {self.cjk_char_width}")
        if not self.end_marks:
            raise ConfigError("end_marks", "must name at least one character")
        if self.max_newline_word_ratio is not None and not 0 <= self.max_newline_word_ratio < math.inf:
            raise ConfigError(
                "max_newline_word_ratio", f"must be a finite number >= 0, got {self.max_newline_word_ratio}"
            )

    def reason(self, doc: dict) -> str | None:
        s = fineweb_stats(
            doc["text"], doc["meta"].get("lang"), self.end_marks, self.short_line_length, self.cjk_char_width
        )
        if s["line_punct"] < self.min_line_punct_ratio:
            return "fineweb_line_punct"
        if s["short_lines"] > self.max_short_line_ratio:
            return "fineweb_short_lines"
        if s["dup_line_chars"] > self.max_dup_line_char_ratio:
            return "fineweb_dup_line_chars"
        if self.max_newline_word_ratio is not None and s["newlines_per_word"] > self.max_newline_word_ratio:
            return "fineweb_newlines"
        return None
