"""Words, lines, paragraphs and sentences for the heuristic filters, in English and Chinese alike.

The published rules (Gopher, C4, FineWeb) count "words" by splitting on whitespace, which makes a
Chinese or Japanese paragraph a single enormous word. Here a text is split one of two ways:

- space-delimited scripts: whitespace-separated tokens with punctuation stripped from both ends
  ("don't" and "3.14" stay whole; a token made only of punctuation such as "--" or "..." is not a word);
- CJK (lang zh/ja/..., or a text whose words are mostly Han or kana when no lang is given): every
  Han ideograph, kana and hangul character is one word, and runs of other letters or digits between
  them ("Python", "3.11") are one word each, as in the space-delimited split.

Korean writes spaces between words, so lang "ko" uses the space-delimited split; hangul counts as a
character-word only inside a text already treated as CJK.
"""

from __future__ import annotations

import re
import unicodedata

# Han (CJK Unified Ideographs, Extension A, compatibility, Extensions B-G), the ideographic iteration
# and zero marks (々〆〇), kana (including half-width katakana) and hangul.
_HAN_KANA = (
    "\u3005-\u3007\u3040-\u309f\u30a0-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff"
    "\uf900-\ufaff\uff66-\uff9f\U00020000-\U0003134f"
)
_HANGUL = "\u1100-\u11ff\u3130-\u318f\uac00-\ud7af"
_CJK = _HAN_KANA + _HANGUL


def _class_of(codepoints: list[int]) -> str:
    """A regex character-class body covering `codepoints`, as compact ranges."""
    parts, start, prev = [], None, None
    for cp in codepoints + [-2]:
        if start is not None and cp == prev + 1:
            prev = cp
            continue
        if start is not None:
            parts.append(f"\\u{start:04x}" if start == prev else f"\\u{start:04x}-\\u{prev:04x}")
        start = prev = cp
    return "".join(parts)


# Unicode punctuation (categories Pc Pd Pe Pf Pi Po Ps) in the Basic Multilingual Plane; punctuation
# outside it is rare enough in text that scanning 1.1M code points at import is not worth it.
_PUNCT_CPS = [c for c in range(0x10000) if unicodedata.category(chr(c)).startswith("P")]
_P = _class_of(_PUNCT_CPS)
_NONASCII_P = _class_of([c for c in _PUNCT_CPS if c > 0x7F])

# A whitespace token from its first to its last non-punctuation character.
_SPACE_WORD = re.compile(rf"[^\s{_P}](?:\S*[^\s{_P}])?")
# One CJK character, or a run of anything else. Inside a run ASCII punctuation is allowed ("don't",
# "3.14") but full-width and other non-ASCII punctuation splits: Chinese puts no space after "，".
_CJK_WORD = re.compile(rf"[{_CJK}]|[^\s{_P}{_CJK}](?:[^\s{_NONASCII_P}{_CJK}]*[^\s{_P}{_CJK}])?")
_HAN_KANA_CHAR = re.compile(f"[{_HAN_KANA}]")
_KANA_CHAR = re.compile("[\u3040-\u309f\u30a0-\u30ff\u31f0-\u31ff\uff66-\uff9f]")
_CJK_CHAR = re.compile(f"[{_CJK}]")

CJK_LANGS = frozenset({"zh", "ja", "yue", "wuu", "gan", "hak", "nan", "lzh", "cmn", "cdo", "hsn"})

# Gopher (Rae et al. 2021, section A.1.1): a document must contain at least two of these English words.
# zh: the eight most frequent grammatical words of modern written Chinese, taken from the top of
# character-frequency lists (e.g. Jun Da's Modern Chinese Character Frequency List), keeping the
# same kinds of words Gopher kept - particles 的 and 了, the copula 是, the preposition 在, the
# conjunction 和, 有 ("have", Gopher's "have"), negation 不 and the demonstrative 这 - and leaving
# out content characters (人, 大) and the numeral 一, which also fills dates and lists.
# ja: the most frequent particles and auxiliaries (の に は を た が で て), the same idea for Japanese.
STOP_WORDS: dict[str, frozenset[str]] = {
    "en": frozenset({"the", "be", "to", "of", "and", "that", "have", "with"}),
    "zh": frozenset({"的", "了", "是", "在", "和", "有", "不", "这"}),
    "ja": frozenset({"の", "に", "は", "を", "た", "が", "で", "て"}),
}


def base_lang(lang: str | None) -> str | None:
    """'zh' from 'zh-Hans', 'zh_CN' or 'ZH'; None stays None."""
    if not lang:
        return None
    return re.split(r"[-_]", lang, maxsplit=1)[0].lower()


def is_cjk(text: str, lang: str | None = None) -> bool:
    """Whether `text` is split into character-words: lang says so, or (no lang) more than half the words are CJK."""
    if lang:
        return base_lang(lang) in CJK_LANGS
    if not _HAN_KANA_CHAR.search(text):
        return False
    n_words = len(_CJK_WORD.findall(text))
    n_han_kana = len(_HAN_KANA_CHAR.findall(text))
    return 2 * n_han_kana > n_words


def split_words(text: str, cjk: bool) -> list[str]:
    """Words of `text` with the split already decided (see `is_cjk`); filters decide once per document."""
    return (_CJK_WORD if cjk else _SPACE_WORD).findall(text)


def words(text: str, lang: str | None = None) -> list[str]:
    """Words of `text`: whitespace tokens without edge punctuation, or CJK character-words (module doc)."""
    return split_words(text, is_cjk(text, lang))


def count_cjk_chars(text: str) -> int:
    return len(_CJK_CHAR.findall(text))


def stop_word_lang(text: str, lang: str | None) -> str | None:
    """Which STOP_WORDS list applies: lang's own (None if it has none), or a guess from the script."""
    if lang:
        return base_lang(lang) if base_lang(lang) in STOP_WORDS else None
    if is_cjk(text):
        return "ja" if _KANA_CHAR.search(text) else "zh"
    return "en"


def lines(text: str) -> list[str]:
    """Non-empty lines, stripped of surrounding whitespace."""
    return [s for line in text.split("\n") if (s := line.strip())]


def paragraphs(text: str) -> list[str]:
    """Blocks separated by one or more blank (or whitespace-only) lines, stripped; empty ones dropped."""
    return [s for block in re.split(r"\n\s*\n", text) if (s := block.strip())]


# A Latin sentence ends at . ! ? (with closing quotes or brackets) followed by whitespace, so "3.14"
# and "e.g.x" do not split; abbreviations such as "e.g. this" do split (no abbreviation list).
_LATIN_END = r"""[.!?]+["'\u201d\u2019)\]\u00bb]*(?=\s)"""
# CJK marks need no following space; closing quotes and brackets stay with their sentence.
_CJK_END = "[\u3002\uff01\uff1f]+[\u201d\u2019\u300d\u300f\uff09\"']*"
_SENTENCE_END = re.compile(f"{_LATIN_END}|{_CJK_END}")
# In Chinese text a half-width full stop is often typed straight before the next character.
_SENTENCE_END_CJK = re.compile(f"{_LATIN_END}|{_CJK_END}|[.!?]+(?=[{_HAN_KANA}])")


def sentences(text: str, lang: str | None = None) -> list[str]:
    """Sentences of `text`, split after . ! ? followed by whitespace and after 。！？.

    For CJK text (lang or detection, as in `words`) a half-width . ! ? directly before a Han or kana
    character also ends a sentence.
    """
    return split_sentences(text, is_cjk(text, lang))


def split_sentences(text: str, cjk: bool) -> list[str]:
    """`sentences` with the CJK decision already made (filters decide once per document)."""
    pattern = _SENTENCE_END_CJK if cjk else _SENTENCE_END
    out, start = [], 0
    for match in pattern.finditer(text):
        if s := text[start : match.end()].strip():
            out.append(s)
        start = match.end()
    if s := text[start:].strip():
        out.append(s)
    return out


def ngrams(seq: list[str], n: int) -> list[tuple[str, ...]]:
    """Consecutive n-grams of `seq` (none if it is shorter than n)."""
    if n < 1:
        raise ValueError(f"n-gram size must be at least 1, got {n}")
    return list(zip(*(seq[i:] for i in range(n))))
