"""The `normalize` step: one Unicode form, no control characters, tidy whitespace, optional boilerplate.

Runs first so that every later rule (hashes for dedup, line-based filters, PII regexes) sees the
same text for what a reader would call the same text: "é" as one code point, "\\r\\n" as "\\n",
no invisible BOMs or zero-width spaces splitting words.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field

from kiln.data.steps.base import Mapper, register
from kiln.data.steps.text import words
from kiln.errors import ConfigError

# Every other line-break convention becomes "\n": CR LF (Windows), lone CR (old Mac), vertical tab,
# form feed, the information separators, NEL and LINE SEPARATOR. PARAGRAPH SEPARATOR becomes a blank
# line so paragraph-based rules still see the break.
_LINE_BREAKS = re.compile("\r\n|[\r\x0b\x0c\x1c\x1d\x1e\x85\u2028]")
_PARAGRAPH_SEPARATOR = "\u2029"
# C0 and C1 controls except tab and newline (the line breaks above are converted before this runs),
# DEL, the byte-order mark and zero-width space used mid-text, and lone surrogates, which JSON
# "\\ud800" escapes can produce and which cannot be written back as UTF-8.
_CONTROL = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x84\x86-\x9f\ufeff\u200b\ud800-\udfff]")
_TRAILING_SPACE = re.compile(r"[^\S\n]+$", re.MULTILINE)

# Short lines matching these (case-insensitive, anywhere in the line) are site furniture rather than
# content: copyright footers, cookie and consent banners, "enable JavaScript" notices, navigation.
# They are phrases, not single words, so a recipe for cookies or an article about JavaScript stays.
DEFAULT_BOILERPLATE = [
    r"\ball rights reserved\b",
    r"\b(this|our) (site|website) uses cookies\b",
    r"\bwe use cookies\b",
    r"\b(accept|allow|manage|reject) (all )?cookies\b",
    r"\bcookie (policy|settings|preferences)\b",
    r"\bprivacy policy\b",
    r"\bterms (of (use|service)|and conditions)\b",
    r"\b(enable|turn on) javascript\b",
    r"\bjavascript (is (disabled|required|not enabled)|must be enabled)\b",
    r"\bskip to (main )?content\b",
    r"\b(sign up for|subscribe to) (our|the) newsletter\b",
]

UNICODE_FORMS = ("NFC", "NFKC", "none")


def normalize_text(
    text: str,
    unicode_form: str = "NFC",
    remove_control_chars: bool = True,
    max_blank_lines: int = 2,
    boilerplate: re.Pattern | None = None,
    boilerplate_max_words: int = 20,
) -> tuple[str, Counter]:
    """The cleaned text and what changed: counts of line breaks, control characters, lines, ..."""
    counts: Counter = Counter()
    text, n = _LINE_BREAKS.subn("\n", text)
    counts["line_breaks_converted"] += n
    if _PARAGRAPH_SEPARATOR in text:
        counts["line_breaks_converted"] += text.count(_PARAGRAPH_SEPARATOR)
        text = text.replace(_PARAGRAPH_SEPARATOR, "\n\n")
    if remove_control_chars:
        text, n = _CONTROL.subn("", text)
        counts["control_chars_removed"] += n
    if unicode_form != "none" and not unicodedata.is_normalized(unicode_form, text):
        text = unicodedata.normalize(unicode_form, text)
        counts["unicode_normalized_docs"] += 1
    if boilerplate is not None:
        kept = []
        for line in text.split("\n"):
            if boilerplate.search(line) and len(words(line)) <= boilerplate_max_words:
                counts["boilerplate_lines_removed"] += 1
            else:
                kept.append(line)
        text = "\n".join(kept)
    text, n = _TRAILING_SPACE.subn("", text)
    counts["trailing_space_lines"] += n
    # k blank lines are k+1 newlines in a row once trailing spaces are gone.
    text, n = re.subn("\n{%d,}" % (max_blank_lines + 2), "\n" * (max_blank_lines + 1), text)
    counts["blank_runs_collapsed"] += n
    text = text.lstrip("\n").rstrip()
    return text, +counts  # unary + drops zero counts


def compile_boilerplate(patterns: list[str]) -> re.Pattern:
    return re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)


@register
@dataclass
class Normalize(Mapper):
    """Unicode normal form, control characters, line breaks, trailing spaces, blank-line runs and
    (when `remove_boilerplate`) short boilerplate lines. Counters: what changed, summed over docs."""

    name = "normalize"
    unicode_form: str = "NFC"  # "NFC" keeps compatibility characters (full-width, ligatures); "NFKC" folds them
    remove_control_chars: bool = True
    max_blank_lines: int = 2  # longer runs of blank lines collapse to this many
    remove_boilerplate: bool = False
    boilerplate_patterns: list[str] = field(default_factory=lambda: list(DEFAULT_BOILERPLATE))
    boilerplate_max_words: int = 20  # a matching line longer than this is content that mentions the phrase

    def validate(self) -> None:
        if self.unicode_form not in UNICODE_FORMS:
            raise ConfigError("unicode_form", f"must be one of {', '.join(UNICODE_FORMS)}, got {self.unicode_form!r}")
        if self.max_blank_lines < 0:
            raise ConfigError("max_blank_lines", f"must be >= 0, got {self.max_blank_lines}")
        if self.boilerplate_max_words < 1:
            raise ConfigError("boilerplate_max_words", f"must be >= 1, got {self.boilerplate_max_words}")
        for i, pattern in enumerate(self.boilerplate_patterns):
            try:
                re.compile(pattern)
            except re.error as err:
                raise ConfigError(
                    f"boilerplate_patterns[{i}]", f"invalid regular expression {pattern!r}: {err}"
                ) from None
        if self.remove_boilerplate and not self.boilerplate_patterns:
            raise ConfigError("boilerplate_patterns", "is empty but remove_boilerplate is true")

    def setup(self) -> None:
        self._boilerplate = compile_boilerplate(self.boilerplate_patterns) if self.remove_boilerplate else None

    def apply(self, doc: dict) -> dict:
        if not hasattr(self, "_boilerplate"):
            self.setup()
        text, counts = normalize_text(
            doc["text"],
            self.unicode_form,
            self.remove_control_chars,
            self.max_blank_lines,
            self._boilerplate,
            self.boilerplate_max_words,
        )
        if text != doc["text"]:
            self.stats.count("docs_changed")
            doc["text"] = text
        for key, n in counts.items():
            self.stats.count(key, n)
        return doc
