"""Domain tagging (`domain`) and domain mixing by downsampling (`mixture`).

`domain` sets `meta["domain"]`: from the recipe's `by_source` table when the document's source is
listed (the user knows best: "github-*" is code), otherwise from a small rule-based classifier over
five domains, checked in this order:

- code: at least `code_min_share` of the non-blank lines look like source code (a statement
  keyword at the start, `;` `{` `}` at the end, an assignment, a comment marker, a decorator or a
  preprocessor line). Prose almost never has these shapes; documentation with examples has some.
- papers: at least `min_signals` of: an "Abstract" heading, a "References"/"Bibliography"
  heading, numeric citations such as [12] or [3, 7], author-year citations "(Smith et al., 2020)",
  "arXiv", "et al.", a DOI.
- news: at least `min_signals` of: an agency dateline "PARIS (Reuters) -", a byline "By Jane Doe",
  a written date "March 3, 2024", reporting verbs ("said on Tuesday", "reported", "according to"),
  a spokesperson/official being quoted.
- docs: at least `min_signals` of: reST or Markdown headings, reST directives/roles, interpreter
  prompts (">>>", "$ "), API words (parameter, argument, returns, method, attribute, module...),
  inline code in backticks or quotes, or a code-line share between `docs_min_code_share` and
  `code_min_share` (documentation shows code but is mostly prose).
- web: everything else.

The rules are deliberately few and readable: their job is to route documents to domain-specific
filters and to the mixture, where a few percent of misrouted documents matter little. A trained
classifier can replace them by tagging `meta.domain` upstream and listing no `by_source`.

`mixture` keeps a subset of each domain so the kept corpus approaches `weights` (see `Mixture`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from kiln.data.steps.base import Deduplicator, Mapper, register
from kiln.errors import ConfigError

DOMAINS = ("code", "papers", "news", "docs", "web")

# A line looks like code if it has one of these shapes. Each is rare in prose: keywords are matched
# with the syntax that follows them ("def name(", "let x =", "import os"), not alone, because a
# wrapped prose line may well start with "return" or "class"; and prose does not start a line with
# "x = ..." or end one with "{" or ";" after a bracket.
_CODE_LINE = re.compile(
    r"""^\s*(?:
        def\s+\w+\s*\( | class\s+\w+\s*[(:{<] | class\s+\w+\s+(?:extends|implements)\b
      | (?:async\s+)?(?:function\s*\w*|func\s+\w+|fn\s+\w+)\s*[(<]
      | (?:let|const|var|auto)\s+\w+\s*[=:;]
      | (?:public|private|protected|static)\s+[\w<>\[\],]+\s+\w+
      | import\s+[\w.]+(?:\s+as\s+\w+)?(?:\s*,\s*[\w.]+)*;?$ | from\s+[.\w]+\s+import\b
      | (?:return|yield|raise|await)(?:$|\s+\S+$|\s.*[-+*/%=<>()\[\]{}"'\d].*[^.!?,:]$)  # with an expression
      | (?:if|elif|else|for|while|with|try|except|finally|case)\b.*:$   # Python block openers
      | (?:pass|break|continue)$
      | \#(?:include|define|ifn?def|endif|pragma)\b       # C preprocessor
      | @[\w.]+(?:\(.*\))?$                               # decorator / annotation
      | (?:\#|//|/\*|\*/)                                  # comment markers at line start
      | [\w.\[\]'"]+\s*(?:[-+*/%|&^]|<<|>>|//|\*\*)?=(?!=)\s*\S  # assignment: x = 1, self.a += b
      | [\w.]+\(.*\)\s*;?$                                # a bare call: print(x), foo(a, b);
      | [)\]}]+[;,]?$                                     # closing brackets only
    )""",
    re.VERBOSE,
)
_CODE_LINE_END = re.compile(r"(?:[;{}]|\)\s*:|\)\s*\{)\s*$")

_PAPER_SIGNALS = [
    re.compile(r"^\s*(?:\d+\.?\s*)?abstract\b", re.I | re.M),
    re.compile(r"^\s*(?:\d+\.?\s*)?(?:references|bibliography)\s*$", re.I | re.M),
    re.compile(r"\[\d{1,3}(?:\s*[,\u2013-]\s*\d{1,3})*\]"),
    re.compile(r"\([A-Z][A-Za-z'\-]+(?: et al\.| and [A-Z][A-Za-z'\-]+)?,? (?:19|20)\d\d[a-z]?\)"),
    re.compile(r"\barxiv\b", re.I),
    re.compile(r"\bet al\."),
    re.compile(r"\bdoi(?:\.org/|:\s*)10\.\d{4,}", re.I),
]
_MONTHS = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sept?(?:ember)?"
    r"|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)\.?"
)
_NEWS_SIGNALS = [
    re.compile(
        r"^[A-Z][A-Z .'\-]{2,}(?:, [A-Z][\w .]+)? \((?:Reuters|AP|AFP|Bloomberg|CNN|Xinhua|UPI)\)"
        r"\s*[-\u2013\u2014]",
        re.M,
    ),  # agency dateline
    re.compile(r"^\s*By [A-Z][a-z]+(?: [A-Z]\.)? [A-Z][a-z]+(?:\s+and [A-Z][a-z]+ [A-Z][a-z]+)?\s*$", re.M),
    re.compile(rf"\b{_MONTHS} \d{{1,2}}, (?:19|20)\d\d\b"),
    re.compile(r"\bsaid (?:on )?(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday|yesterday|today)\b"),
    re.compile(r"\b(?:reported|according to|told reporters|news agency|press conference)\b", re.I),
    re.compile(r"\b(?:spokes(?:man|woman|person)|officials? said|minister said)\b", re.I),
]
_DOCS_SIGNALS = [
    re.compile(r"^(?:=+|-+|~+|\*+|\^+)\s*$", re.M),  # reST heading underline
    re.compile(r"^#{1,6} \S", re.M),  # Markdown heading
    re.compile(r"^\s*\.\. [\w-]+::|:(?:func|class|meth|mod|attr|ref|param|returns?):", re.M),
    re.compile(r"^\s*(?:>>>|\$) \S|::=", re.M),  # prompts; grammar productions
    re.compile(r"^\s*(?:Note|Warning|See also|Examples?|(?:Changed|New|Added) in version|Deprecated since)\b", re.M),
    re.compile(
        r"\b(?:parameters?|arguments?|returns?|methods?|attributes?|modules?|configur\w+|"
        r"install\w*|usage|deprecated|keyword|default|syntax|expression|statement)\b",
        re.I,
    ),
    # Inline code: ``x`` or `x` (reST, Markdown), or a quoted name with a dot, underscore or "()"
    # (the plain-text rendering of Python's documentation).
    re.compile(r"``[^`\n]+``|`[^`\n]+`|\"\w*[._(][\w.]*\)?\""),
]


def code_line_share(text: str) -> float:
    """Share of non-blank lines that look like source code (see `_CODE_LINE`)."""
    n = code = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        n += 1
        if _CODE_LINE.match(line) or _CODE_LINE_END.search(line):
            code += 1
    return code / n if n else 0.0


def domain_signals(text: str) -> dict[str, float]:
    """The classifier's evidence: the code-line share, and how many distinct signals of each kind fire."""
    return {
        "code": code_line_share(text),
        "papers": sum(bool(p.search(text)) for p in _PAPER_SIGNALS),
        "news": sum(bool(p.search(text)) for p in _NEWS_SIGNALS),
        "docs": sum(bool(p.search(text)) for p in _DOCS_SIGNALS),
    }


def classify_domain(
    text: str, code_min_share: float = 0.5, docs_min_code_share: float = 0.1, min_signals: int = 3
) -> str:
    """One of DOMAINS for `text`, by the rules in the module docstring."""
    s = domain_signals(text)
    if s["code"] >= code_min_share:
        return "code"
    if s["papers"] >= min_signals:
        return "papers"
    if s["news"] >= min_signals:
        return "news"
    # Documentation shows some code; count a middling code share as one more docs signal.
    if s["docs"] + (s["code"] >= docs_min_code_share) >= min_signals:
        return "docs"
    return "web"


@register
@dataclass
class Domain(Mapper):
    """Sets `meta["domain"]`: `by_source[doc["source"]]` if listed, else `classify_domain(text)`."""

    name = "domain"
    by_source: dict[str, str] = field(default_factory=dict)
    # 0.5: a source file is mostly statements even with long docstrings, documentation with examples
    # is mostly prose. Measured on CPython 3.11: the stdlib's top-level .py files score a median 0.74
    # (90% above 0.54); pydoc's reference topics a median 0.01 and at most 0.44.
    code_min_share: float = 0.5
    docs_min_code_share: float = 0.1
    # Three independent signals: any single one (a date, "et al.", the word "default") is common in
    # ordinary web text; three together rarely are.
    min_signals: int = 3

    def validate(self) -> None:
        for key in ("code_min_share", "docs_min_code_share"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(key, f"must be in [0, 1], got {getattr(self, key)}")
        if self.docs_min_code_share > self.code_min_share:
            raise ConfigError(
                "docs_min_code_share",
                f"must be <= code_min_share ({self.code_min_share}), got {self.docs_min_code_share}",
            )
        if self.min_signals < 1:
            raise ConfigError("min_signals", f"must be >= 1, got {self.min_signals}")
        for source, domain in self.by_source.items():
            if not domain:
                raise ConfigError(f"by_source.{source}", "domain must be a non-empty string")

    def apply(self, doc: dict) -> dict:
        domain = self.by_source.get(doc["source"])
        if domain is None:
            domain = classify_domain(doc["text"], self.code_min_share, self.docs_min_code_share, self.min_signals)
            self.stats.count("classified")
        doc["meta"]["domain"] = domain
        self.stats.count(f"domain_{domain}")
        return doc


def doc_domain(doc: dict) -> str:
    """The document's domain; its source when no `domain` step ran (a source is a domain of its own)."""
    return doc["meta"].get("domain") or doc["source"]


def unit_hash(doc_id: str, seed: int) -> float:
    """A stable uniform number in [0, 1) from the id: the same document is kept or dropped on every
    run, worker count and machine (Python's hash() is salted per process)."""
    digest = hashlib.blake2b(f"{seed}:{doc_id}".encode("utf-8"), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)  # 53 bits: exact in a float64


def _save_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _save_npy(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def plan_mixture(
    sizes: dict[str, np.ndarray], hashes: dict[str, np.ndarray], weights: dict[str, float]
) -> tuple[dict[str, float], dict[str, float]]:
    """Per-domain hash thresholds (keep a document iff its hash < threshold) and the kept amounts.

    `sizes[d]` are the domain's documents' amounts (1 each for docs, bytes for bytes), `hashes[d]`
    their `unit_hash`. With p_d the weights normalised over the domains present in the data and A_d
    what each has, the largest mixture with every p_d exactly met is T = min_d A_d / p_d (the scarcest
    domain relative to its weight keeps everything); each domain then keeps T * p_d. Within a domain
    the documents are taken in hash order until the next one would overshoot, so the achieved
    proportions are exact up to one document per domain and the chosen set is a random sample.
    Domains present but without weight keep nothing; weighted domains absent from the data are
    reported as achieved 0 and the others keep their weights' ratios.
    """
    present = {d: float(weights.get(d, 0.0)) for d in sizes if sizes[d].sum() > 0}
    total_weight = sum(w for w in present.values() if w > 0)
    thresholds = {d: 0.0 for d in sizes}
    kept = {d: 0.0 for d in sizes}
    if total_weight <= 0:
        return thresholds, kept
    available = {d: float(sizes[d].sum()) for d in present}
    target_total = min(available[d] * total_weight / w for d, w in present.items() if w > 0)
    for d, w in present.items():
        if w <= 0:
            continue
        target = target_total * w / total_weight
        order = np.argsort(hashes[d], kind="stable")
        cumulative = np.cumsum(sizes[d][order])
        # Within float rounding of the target counts as meeting it (the scarcest domain keeps all).
        n_keep = int(np.searchsorted(cumulative, target * (1 + 1e-9), side="right"))
        thresholds[d] = 1.0 if n_keep == order.size else float(hashes[d][order[n_keep]])
        kept[d] = float(cumulative[n_keep - 1]) if n_keep else 0.0
    return thresholds, kept


@register
@dataclass
class Mixture(Deduplicator):
    """Downsamples domains so the kept corpus approaches `weights` (it cannot add data, only drop it).

    Runs after `domain` (a document without `meta.domain` counts under its source). `index` writes
    every task's per-domain amounts and id hashes, `resolve` picks per domain the share to keep that
    gives the largest corpus with the requested proportions (`plan_mixture`) and writes it with the
    requested, available and achieved proportions to `mixture.json`; `reason` keeps a document iff
    the stable hash of its id is below its domain's threshold, else "mixture_downsampled".
    """

    name = "mixture"
    weights: dict[str, float] = field(default_factory=dict)
    unit: str = "bytes"  # "bytes": proportions of UTF-8 text bytes (what training sees); "docs": of documents
    seed: int = 0  # a different seed draws a different (equally valid) sample

    def validate(self) -> None:
        if self.unit not in ("bytes", "docs"):
            raise ConfigError("unit", f"must be 'bytes' or 'docs', got {self.unit!r}")
        if not self.weights:
            raise ConfigError("weights", "needs at least one domain, e.g. { web = 0.7, code = 0.3 }")
        for domain, weight in self.weights.items():
            if not weight >= 0:
                raise ConfigError(f"weights.{domain}", f"must be >= 0, got {weight}")
        if sum(self.weights.values()) <= 0:
            raise ConfigError("weights", "at least one weight must be > 0")

    def index(self, docs: Iterable[dict], workdir: Path, task: int) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        sizes: dict[str, list[int]] = defaultdict(list)
        hashes: dict[str, list[float]] = defaultdict(list)
        for doc in docs:
            d = doc_domain(doc)
            sizes[d].append(len(doc["text"].encode("utf-8")) if self.unit == "bytes" else 1)
            hashes[d].append(unit_hash(doc["id"], self.seed))
        names = sorted(sizes)
        for i, d in enumerate(names):
            _save_npy(
                workdir / f"task-{task:05d}.domain-{i:03d}.npy",
                np.stack([np.array(sizes[d], dtype=np.float64), np.array(hashes[d], dtype=np.float64)]),
            )
        # Domain names go in JSON, not file names: user-defined domains may hold any character.
        _save_json(workdir / f"task-{task:05d}.domains.json", names)

    def resolve(self, workdir: Path, n_tasks: int) -> dict:
        sizes: dict[str, list[np.ndarray]] = defaultdict(list)
        hashes: dict[str, list[np.ndarray]] = defaultdict(list)
        for t in range(n_tasks):
            for i, d in enumerate(json.loads((workdir / f"task-{t:05d}.domains.json").read_text())):
                s, h = np.load(workdir / f"task-{t:05d}.domain-{i:03d}.npy")
                sizes[d].append(s)
                hashes[d].append(h)
        sizes_all = {d: np.concatenate(v) for d, v in sizes.items()}
        hashes_all = {d: np.concatenate(v) for d, v in hashes.items()}
        thresholds, kept = plan_mixture(sizes_all, hashes_all, self.weights)
        available = {d: float(s.sum()) for d, s in sizes_all.items()}
        weight_sum = sum(self.weights.values())
        domains = sorted(set(self.weights) | set(available))
        requested = {d: self.weights.get(d, 0.0) / weight_sum for d in domains}
        total_available, total_kept = sum(available.values()), sum(kept.values())
        achieved = {d: (kept.get(d, 0.0) / total_kept if total_kept else 0.0) for d in domains}
        plan = {
            "unit": self.unit,
            "thresholds": thresholds,
            "requested": requested,
            "achieved": achieved,
            "input": {d: (available.get(d, 0.0) / total_available if total_available else 0.0) for d in domains},
            "available": {d: available.get(d, 0.0) for d in domains},
            "kept": {d: kept.get(d, 0.0) for d in domains},
            "missing": [d for d in domains if self.weights.get(d, 0) > 0 and not available.get(d)],
        }
        _save_json(workdir / "mixture.json", plan)
        stats = {
            "requested": requested,
            "achieved": achieved,
            "missing": plan["missing"],
            f"available_{self.unit}": total_available,
            f"kept_{self.unit}": total_kept,
        }
        for d in domains:
            stats[f"requested_{d}"] = round(requested[d], 6)
            stats[f"achieved_{d}"] = round(achieved[d], 6)
        return stats

    def load(self, workdir: Path, task: int) -> None:
        self._thresholds = json.loads((workdir / "mixture.json").read_text())["thresholds"]

    def reason(self, doc: dict) -> str | None:
        # A domain `index` never saw cannot occur (the same documents come back); 0.0 drops it anyway.
        if unit_hash(doc["id"], self.seed) < self._thresholds.get(doc_domain(doc), 0.0):
            return None
        return "mixture_downsampled"
