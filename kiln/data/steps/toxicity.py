"""Toxicity filter (`toxicity`): a word-list score per document, plus an optional classifier hook.

Score = flagged words / words, with words from `kiln.data.steps.text.words` in the document's
language (`meta.lang`), so Chinese counts characters. A list entry may be several words ("blow
job", or a two-character Chinese word); each word of a matched entry counts as flagged. The score
goes to `meta["toxicity"]`; a document scoring above `max_score` is dropped as "toxic".

Lists:
- English (`builtin_list`): the 916-entry list inside the `better-profanity` wheel (MIT, v0.7.0,
  `better_profanity/profanity_wordlist.txt`), read from the installed package, never downloaded.
  It contains ordinary words that are only sometimes offensive; `ignore_words` removes those by
  default (see IGNORED_BY_DEFAULT). C4's LDNOOBW list is not used: the only wheel that ships it
  (dolma) needs Python < 3.13, and datatrove downloads it at run time.
- Any language (`word_list_files`): UTF-8 files, one entry per line, `#` starts a comment. No
  Chinese list ships: we found no permissively licensed one in a PyPI wheel to cite, so Chinese is
  supported through user files only (entries are split into characters like the text is).

Classifier hook (`classifier = "package.module:function"`): a function text -> score in [0, 1],
imported once per worker. Its score goes to `meta["toxicity_classifier"]` and drops a document
above `max_classifier_score` as "toxic_classifier". With `builtin_list = false` and no files, the
classifier is used instead of the list; otherwise alongside it.
"""

from __future__ import annotations

import importlib
import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kiln.data.steps.base import Filter, register
from kiln.data.steps.text import words
from kiln.errors import ConfigError

# Entries of better-profanity's list that are ordinary words far more often than insults, grouped by
# why. Flagging them would score Bible text, medicine, crime and history reporting, drug policy,
# programming ("foobar") and sailing ("seamen", "sandbar"). Identity terms are removed too: Dodge
# et al. 2021 ("Documenting Large Webtext Corpora", EMNLP) found that C4's word-list filter
# disproportionately removed text by and about LGBTQ+ people. What remains are slurs and explicit
# sexual or scatological vocabulary, whose density still separates abusive and pornographic pages.
IGNORED_BY_DEFAULT = [
    # everyday words and mild oaths
    "god",
    "hell",
    "damn",
    "crap",
    "kill",
    "fat",
    "ugly",
    "suck",
    "sucked",
    "sucking",
    "jerk",
    "lust",
    "lusting",
    "lusty",
    "stupid",
    "dummy",
    "moron",
    "weirdo",
    "nimrod",
    "ninny",
    "doofus",
    "dopey",
    "drunk",
    "stoned",
    "vomit",
    "tinkle",
    "potty",
    "pee",
    "poop",
    "fart",
    "hump",
    "rump",
    "tush",
    "undies",
    "toots",
    "woody",
    "willies",
    "wedgie",
    "tramp",
    "wench",
    "vixen",
    "prude",
    "sissy",
    "trashy",
    "tawdry",
    "sleaze",
    "sleazy",
    "raunch",
    "racy",
    "steamy",
    "vulgar",
    "scum",
    "smut",
    "omg",
    "lmao",
    "lmfao",
    "wtf",
    "stfu",
    "gtfo",
    "maxi",
    "len",
    "pawn",
    "rum",
    "vodka",
    "souse",
    "soused",
    "hooch",
    "hootch",
    "revue",
    "stroke",
    "strip",
    "screw",
    "screwed",
    "screwing",
    "thrust",
    "snatch",
    "snuff",
    "sniper",
    "napalm",
    "seaman",
    "seamen",
    "sandbar",
    "foobar",
    "fubar",
    "organ",
    "facial",
    "fingering",
    "penetrate",
    "seduce",
    "naked",
    "nude",
    "nudes",
    "sex",
    "sexual",
    "erotic",
    "erotism",
    "kinky",
    "knob",
    "nob",
    "wad",
    "prig",
    "hoar",
    "lech",
    "whiz",
    "dink",
    "dinks",
    # anatomy and medicine
    "oral",
    "orally",
    "womb",
    "ovum",
    "ovums",
    "ovary",
    "uterus",
    "vagina",
    "vulva",
    "labia",
    "hymen",
    "penis",
    "penile",
    "penial",
    "phallic",
    "phalli",
    "testes",
    "testis",
    "testicle",
    "teste",
    "scrotum",
    "semen",
    "sperm",
    "glans",
    "foreskin",
    "gonad",
    "gonads",
    "pubic",
    "pubis",
    "rectal",
    "rectum",
    "rectus",
    "breasts",
    "nipple",
    "nipples",
    "teat",
    "clitoris",
    "menses",
    "erect",
    "erection",
    "ejaculate",
    "orgasm",
    "urine",
    "urinal",
    "tampon",
    "herpes",
    "hiv",
    "pms",
    "loin",
    "loins",
    "leper",
    "inbred",
    "incest",
    "virgin",
    "unwed",
    "lube",
    # drugs, weapons and crime as reported
    "weed",
    "hemp",
    "pot",
    "meth",
    "pcp",
    "toke",
    "ganja",
    "reefer",
    "heroin",
    "opium",
    "opiate",
    "peyote",
    "valium",
    "junkie",
    "junky",
    "hookah",
    "uzi",
    "thug",
    "murder",
    "molest",
    "rape",
    "raped",
    "raper",
    "raping",
    "rapist",
    "pedophile",
    "slave",
    # history and politics
    "nazi",
    "nazism",
    "hitler",
    "reich",
    "kkk",
    "klan",
    "pinko",
    # identity terms
    "gay",
    "gays",
    "homo",
    "queer",
    "queers",
    "lez",
    "lesbians",
    "lesbos",
    "dyke",
    "dykes",
    "gae",
    "gai",
    "gey",
    "ghay",
    "ghey",
    # names, places and other meanings (Wang is a common Chinese surname; the dong is Vietnam's currency)
    "wang",
    "dong",
    "dick",
    "willy",
    "fanny",
    "paddy",
    "guido",
    "weiner",
    "hebe",
    "titi",
    "yury",
    "cipa",
    "spac",
    "yaoi",
    "massa",
    "playboy",
    "flange",
    "pasty",
    "pastie",
    "sadism",
    "sadist",
    "masochist",
    "bondage",
    "voyeur",
    "herp",
    "teez",
    "mams",
    "pimp",
]

_BUILTIN_PACKAGE = "better_profanity"
_BUILTIN_FILE = "profanity_wordlist.txt"


def read_word_list(path: Path) -> list[str]:
    """Entries of a word-list file: one per line, blank lines and `#` comments skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("word_list_files", f"cannot read word list {path}: {err}") from None
    return [s for line in text.splitlines() if (s := line.split("#", 1)[0].strip())]


def builtin_word_list() -> list[str]:
    """better-profanity's English list, read from the installed wheel."""
    try:
        resource = importlib.resources.files(_BUILTIN_PACKAGE).joinpath(_BUILTIN_FILE)
        return [s for line in resource.read_text(encoding="utf-8").splitlines() if (s := line.strip())]
    except (ModuleNotFoundError, FileNotFoundError):
        raise ConfigError(
            "builtin_list",
            "needs the better-profanity package (pip install better-profanity), "
            "or set builtin_list = false and give word_list_files",
        ) from None


class WordList:
    """Entries as lowercased word tuples, matched over a document's words at every length they have."""

    def __init__(self, entries: list[str]):
        self.phrases: dict[int, set[tuple[str, ...]]] = {}
        for entry in entries:
            # The same split as the text, so "ass-fucker" stays one word and "傻逼" becomes two.
            key = tuple(w.lower() for w in words(entry))
            if key:
                self.phrases.setdefault(len(key), set()).add(key)
        self.singles = {p[0] for p in self.phrases.get(1, ())}
        self.firsts = {n: {p[0] for p in phrases} for n, phrases in self.phrases.items()}

    def __len__(self) -> int:
        return sum(len(s) for s in self.phrases.values())

    def spans(self, lowered: list[str]) -> list[tuple[int, int]]:
        """(start, length) of every entry occurrence in lowercased words, by start."""
        # Single words (most entries) by a set lookup per word; phrases only where their first word
        # could start one, so a clean document costs one lookup per word and length.
        found = [(i, 1) for i, w in enumerate(lowered) if w in self.singles]
        for n, phrases in self.phrases.items():
            if n == 1:
                continue
            firsts = self.firsts[n]
            found.extend(
                (i, n)
                for i in range(len(lowered) - n + 1)
                if lowered[i] in firsts and tuple(lowered[i : i + n]) in phrases
            )
        return sorted(found)

    def flagged(self, doc_words: list[str]) -> int:
        """How many of `doc_words` are inside a list entry (each word counted once)."""
        hit = [False] * len(doc_words)
        for i, n in self.spans([w.lower() for w in doc_words]):
            hit[i : i + n] = [True] * n
        return sum(hit)


def toxicity_score(text: str, word_list: WordList, lang: str | None = None) -> float:
    """Flagged words / words (0.0 for a text without words)."""
    doc_words = words(text, lang)
    return word_list.flagged(doc_words) / len(doc_words) if doc_words else 0.0


def import_function(spec: str) -> Callable[[str], float]:
    """The callable named by "package.module:function"."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError("classifier", f"must look like 'package.module:function', got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError("classifier", f"cannot import {spec!r}: {err}") from None
    if not callable(fn):
        raise ConfigError("classifier", f"{spec!r} is not callable")
    return fn


@register
@dataclass
class Toxicity(Filter):
    """Drops documents whose share of listed offensive words exceeds `max_score` (module docstring)."""

    name = "toxicity"
    # 0.01 = one flagged word per 100. C4 dropped a page for a single listed word, which removes
    # news, fiction and medical pages that quote one; a rate keeps a long article with an incidental
    # word and still drops pages where such words are the content (abusive or pornographic pages run
    # at several percent). A short text with one hit (say 1 of 40 words) is dropped.
    max_score: float = 0.01
    builtin_list: bool = True
    ignore_words: list[str] = field(default_factory=lambda: list(IGNORED_BY_DEFAULT))
    word_list_files: list[str] = field(default_factory=list)
    classifier: str = ""
    # 0.5: the decision boundary of a probability-like score; set it to the classifier's own
    # calibrated threshold (Dolma used 0.4 for its fastText hate/NSFW scores).
    max_classifier_score: float = 0.5

    def validate(self) -> None:
        if not 0.0 <= self.max_score <= 1.0:
            raise ConfigError("max_score", f"must be in [0, 1], got {self.max_score}")
        if not 0.0 <= self.max_classifier_score <= 1.0:
            raise ConfigError("max_classifier_score", f"must be in [0, 1], got {self.max_classifier_score}")
        if not self.builtin_list and not self.word_list_files and not self.classifier:
            raise ConfigError(
                "builtin_list", "nothing to score with: enable builtin_list, give word_list_files or a classifier"
            )
        if self.builtin_list:
            builtin_word_list()  # fails here, naming the package, rather than in a worker
        for i, path in enumerate(self.word_list_files):
            if not Path(path).is_file():
                raise ConfigError(f"word_list_files[{i}]", f"no such file: {path}")
        if self.classifier:
            import_function(self.classifier)

    def setup(self) -> None:
        if getattr(self, "_ready", False):
            return
        entries = builtin_word_list() if self.builtin_list else []
        for path in self.word_list_files:
            entries.extend(read_word_list(Path(path)))
        ignored = {w.lower() for w in self.ignore_words}
        entries = [e for e in entries if e.lower() not in ignored]
        self._word_list = WordList(entries) if entries else None
        self._classify = import_function(self.classifier) if self.classifier else None
        self._ready = True

    def __getstate__(self) -> dict:
        # The imported classifier may not pickle; workers rebuild everything in setup().
        state = dict(self.__dict__)
        for key in ("_ready", "_word_list", "_classify"):
            state.pop(key, None)
        return state

    def reason(self, doc: dict) -> str | None:
        self.setup()
        if self._word_list is not None:
            score = toxicity_score(doc["text"], self._word_list, doc["meta"].get("lang"))
            doc["meta"]["toxicity"] = round(score, 6)
            if score > 0:
                self.stats.count("flagged_docs")
            if score > self.max_score:
                return "toxic"
        if self._classify is not None:
            score = float(self._classify(doc["text"]))
            if not 0.0 <= score <= 1.0:
                raise ValueError(
                    f"toxicity classifier {self.classifier} returned {score} for document "
                    f"{doc['id']!r}; it must return a score in [0, 1]"
                )
            doc["meta"]["toxicity_classifier"] = round(score, 6)
            if score > self.max_classifier_score:
                return "toxic_classifier"
        return None
