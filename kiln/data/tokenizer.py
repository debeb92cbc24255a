"""Byte-level BPE tokenizer: training on a corpus, loading, encoding and decoding.

Built on the Hugging Face ``tokenizers`` library, so the saved ``tokenizer.json`` loads as is in
``transformers.PreTrainedTokenizerFast(tokenizer_file=...)`` and in any HF-compatible server.
Byte-level means every UTF-8 string (code, Chinese, emoji) round-trips exactly with no unknown token.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from kiln.data.config import TokenizerConfig
from kiln.data.corpus import choose_split_ids, iter_documents
from kiln.data.readers import has_lone_surrogate
from kiln.data.unigram import build_untrained_unigram, too_many_characters, unigram_trainer, with_byte_fallback
from kiln.errors import DataError
from kiln.files import copy_file_atomic, publishing, write_text_atomic
from kiln.progress import progress_visible

# Reserved first so their ids (0..n-1) never move when the vocabulary size changes, and later
# stages (chat SFT, tools) can rely on them without resizing the embedding.
SPECIAL_TOKENS: list[str] = [
    "<|endoftext|>",  # end of a document in pretraining data
    "<|pad|>",  # padding in batched post-training / inference
    "<|system|>",  # chat roles: each turn starts with its role token ...
    "<|user|>",
    "<|assistant|>",
    "<|end|>",  # ... and ends with this one
    # What masked-language modelling puts in place of a token to predict (BERT's [MASK]). It took the
    # first reserved slot: every other id stays where it was.
    "<|mask|>",
    *[f"<|reserved_{k}|>" for k in range(9)],  # for later stages (tools, images, FIM) without a new vocab
]
EOT = "<|endoftext|>"
MASK = "<|mask|>"
SENTINEL = "<|sentinel_{}|>"  # the k-th noise span of T5 span corruption (kiln.data.span)

# The GPT-4 (cl100k) pre-split: contractions, letter runs with one leading non-letter, numbers in
# groups of at most three digits, punctuation runs, and whitespace kept apart from words except a
# single leading space. Keeping runs of indentation whole suits the large share of code we train on.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# What the tokenizers library is handed at once, so that a pathological line costs what ordinary
# text of its size costs (docs/data.md#tokenizer-limits). It keeps per-character alignment data for
# every text it pre-tokenizes and per-token data for every text it encodes (a 50 MB line with
# spaces peaked at 8.9 GB in training; a 5 MB one took 1 GB to encode), and the BPE trainer rescans
# a whole word at every merge inside it (a 50 MB line without whitespace did not finish).
MAX_PIECE_CHARS = 1 << 16  # longer texts go in pieces, cut where the pre-split cuts anyway
ENCODE_BATCH_CHARS = 1 << 20  # characters encoded per call of the library
MAX_TRAIN_WORD_CHARS = 64  # the trainer sees longer runs of non-whitespace in slices of this length
# Places the pre-split (SPLIT_PATTERN) always separates: before a space between two non-spaces,
# after a newline followed by a non-space. Pieces cut there encode to the ids of the whole text.
_PIECE_BOUNDARY = re.compile(r"(?<=\S) (?=\S)|(?<=\n)(?=\S)")
_BOUNDARY_SEARCH_CHARS = 4096  # looked for near the end of a piece first
_LONG_RUN = re.compile(r"\S{%d,}" % (MAX_TRAIN_WORD_CHARS + 1))


def text_pieces(text: str, max_chars: int = MAX_PIECE_CHARS) -> list[str]:
    """text in pieces of at most max_chars (one piece, text itself, when it is that short), cut at
    the last _PIECE_BOUNDARY that fits; a stretch with none (a run of non-whitespace) is cut at
    max_chars, the one place where the pieces' tokens differ from the whole text's."""
    pieces, start = [], 0
    while len(text) - start > max_chars:
        limit = start + max_chars
        cut = None
        for low in (max(start + 1, limit - _BOUNDARY_SEARCH_CHARS), start + 1):
            for match in _PIECE_BOUNDARY.finditer(text, low, limit):
                cut = match.start()
            if cut is not None:
                break
        cut = cut or limit
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:] if start else text)
    return pieces


def training_pieces(text: str) -> Iterator[str]:
    """text as the tokenizer trainer sees it: text_pieces, with runs of non-whitespace longer than
    MAX_TRAIN_WORD_CHARS cut into slices of that length. Ordinary text goes through whole."""
    for piece in text_pieces(text):
        start = 0
        for run in _LONG_RUN.finditer(piece):
            if run.start() > start:
                yield piece[start : run.start()]
            for at in range(run.start(), run.end(), MAX_TRAIN_WORD_CHARS):
                yield piece[at : min(at + MAX_TRAIN_WORD_CHARS, run.end())]
            start = run.end()
        if start < len(piece):
            yield piece[start:] if start else piece


@contextmanager
def rust_threads():
    """Let the Rust side use all cores for the duration of a batch call.

    With TOKENIZERS_PARALLELISM unset, tokenizers 0.23 measured single-threaded here (2 cores:
    6.6 MB in 5.9 s, vs 2.6 s with it set). The variable is only set for the call and removed
    afterwards, so tokenizers' own guard (it turns threads off in processes forked after they
    were used) still applies; a value the user set is left alone.
    """
    if "TOKENIZERS_PARALLELISM" in os.environ:
        yield
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)


# What an imported (Hugging Face) tokenizer says about itself, beside its tokenizer.json.
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # newer transformers save the template in its own file
HF_TOKENIZER_FILES = (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, CHAT_TEMPLATE_FILE)
ROLE_KEYS = ("eos_token", "bos_token", "pad_token", "unk_token")
# A Kiln-trained tokenizer has no config: <|endoftext|> separates packed documents, so it both ends
# one and opens the next (eos and bos, as in GPT-2), and <|pad|> pads.
KILN_ROLES = {"eos_token": EOT, "bos_token": EOT, "pad_token": "<|pad|>", "unk_token": None}


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_config(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_hf_tokenizer_config(folder: Path) -> tuple[dict[str, tuple[str | None, str]], str | None, str]:
    """({role key: (token text or None, the file that set it)}, chat template or None, where the
    template came from) from tokenizer_config.json, special_tokens_map.json and chat_template.jinja
    in `folder`. A key set in neither file is absent (the Kiln default applies); a key set to null
    means the tokenizer has no such token."""
    roles: dict[str, tuple[str | None, str]] = {}
    template, template_from = None, ""
    for name in (SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG):  # tokenizer_config.json wins where both say
        path = folder / name
        if not path.is_file():
            continue
        data = _read_config(path)
        for key in ROLE_KEYS:
            if key in data:
                roles[key] = (_token_text(data[key]), f"{path}: {key}")
        if name == TOKENIZER_CONFIG and data.get("chat_template") is not None:
            template, template_from = data["chat_template"], f"{path}: chat_template"
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        template, template_from = (
            (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8"),
            str(folder / CHAT_TEMPLATE_FILE),
        )
    if isinstance(template, list):  # several named templates: the one called "default" is the chat one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise DataError(f"{template_from}: must be a Jinja template string, got {type(template).__name__}")
    return roles, template, template_from


class Tokenizer:
    """A tokenizer.json with the few operations the rest of Kiln needs, and its special tokens.

    The roles (eos: ends a document, bos: opens one, pad) come from the tokenizer's own
    tokenizer_config.json / special_tokens_map.json when it has them (an imported Hugging Face
    tokenizer: Llama's <s> and </s>), else Kiln's names (KILN_ROLES) where the vocabulary has them.
    chat_template is the Jinja template such a config carries (None for a Kiln-trained tokenizer,
    whose chat format is kiln.data.chat's role tokens)."""

    def __init__(
        self,
        hf: HFTokenizer,
        path: Path | None = None,
        sha256: str = "",
        roles: dict[str, tuple[str | None, str]] | None = None,
        chat_template: str | None = None,
    ):
        self.hf = hf
        self.path = path
        self.sha256 = sha256
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.configured = dict(roles or {})  # what the config files set, for export to write back
        self.chat_template = chat_template
        self.special: dict[str, str | None] = {}
        for key in ROLE_KEYS:
            if key in self.configured:
                token, where = self.configured[key]
                if token is not None and hf.token_to_id(token) is None:
                    raise DataError(f"{where}: {token!r} is not in the vocabulary of {path}")
            else:
                token = KILN_ROLES[key] if KILN_ROLES[key] and hf.token_to_id(KILN_ROLES[key]) is not None else None
            self.special[key] = token
        self.eos_id = self._id("eos_token")
        self.bos_id = self._id("bos_token")
        self.pad_id = self._id("pad_token")

    def _id(self, key: str) -> int | None:
        token = self.special[key]
        return None if token is None else self.hf.token_to_id(token)

    @property
    def eot_id(self) -> int:
        """The end-of-document (eos) token: where pretraining data ends a document and generation stops."""
        if self.eos_id is None:
            raise DataError(
                f"{self.path}: the tokenizer has no end-of-text token (no eos_token in its "
                f"{TOKENIZER_CONFIG} or {SPECIAL_TOKENS_MAP}, and no {EOT!r} in its vocabulary)"
            )
        return self.eos_id

    @property
    def prefix_id(self) -> int:
        """The token a document starts after: bos, else eos (lm-eval's prefix token, the one
        generation and the first rolling-perplexity window condition on)."""
        return self.bos_id if self.bos_id is not None else self.eot_id

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"{path}: tokenizer file not found (run the tokenizer stage first)")
        data = path.read_bytes()
        try:
            hf = HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as err:  # the Rust side raises plain Exception with its parse message
            raise DataError(f"{path}: not a valid tokenizer.json ({err})") from None
        roles, template, _ = read_hf_tokenizer_config(path.parent)
        return cls(hf, path, hashlib.sha256(data).hexdigest(), roles, template)

    def token_id(self, special: str) -> int:
        token_id = self.hf.token_to_id(special)
        if token_id is None:
            raise DataError(f"{self.path}: tokenizer has no token {special!r}")
        return token_id

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """parse_special=False encodes a literal "<|endoftext|>" in text as ordinary bytes, which is
        what raw documents need: their text must never inject control tokens."""
        return self.encode_batch([text], parse_special)[0]

    def encode_batch(self, texts: list[str], parse_special: bool = True) -> list[list[int]]:
        # Multithreaded in Rust; much faster than a Python loop over encode().
        self.hf.encode_special_tokens = not parse_special
        try:
            return self._encode_in_pieces(texts)
        except TypeError:
            # The tokenizers library calls a text with a lone surrogate (a "\ud800" JSON escape, a
            # surrogateescape'd argument) not a string; readers refuse those, this names any left.
            bad = next((i for i, text in enumerate(texts) if isinstance(text, str) and has_lone_surrogate(text)), None)
            if bad is None:
                raise
            raise DataError(
                f"text {bad} of {len(texts)} to encode holds a lone surrogate, which is not UTF-8"
            ) from None
        finally:
            self.hf.encode_special_tokens = False

    def _encode_in_pieces(self, texts: list[str]) -> list[list[int]]:
        """Long texts in text_pieces, at most ENCODE_BATCH_CHARS per library call: the library's
        per-token data of one call is freed before the next, whatever the length of a text."""
        pieces = [text_pieces(text) if isinstance(text, str) else [text] for text in texts]
        if all(len(p) == 1 for p in pieces) and sum(len(t) for t in texts) <= ENCODE_BATCH_CHARS:
            with rust_threads():
                return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]
        out: list[list[int]] = [[] for _ in texts]
        batch, owners, size = [], [], 0
        for owner, parts in enumerate(pieces):
            for part in parts:
                batch.append(part)
                owners.append(owner)
                size += len(part)
                if size >= ENCODE_BATCH_CHARS:
                    self._encode_into(out, batch, owners)
                    batch, owners, size = [], [], 0
        self._encode_into(out, batch, owners)
        return out

    def _encode_into(self, out: list[list[int]], batch: list[str], owners: list[int]) -> None:
        with rust_threads():
            encodings = self.hf.encode_batch(batch, add_special_tokens=False)
        for owner, encoding in zip(owners, encodings):
            out[owner].extend(encoding.ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)


def find_tokenizer(path: str | Path) -> Path:
    """tokenizer.json in the checkpoint folder or in a run folder above it."""
    path = Path(path).resolve()
    for folder in [path, *path.parents]:
        for candidate in (folder / "tokenizer.json", folder / "tokenizer" / "tokenizer.json"):
            if candidate.is_file():
                return candidate
    raise DataError(f"{path}: no tokenizer.json next to the checkpoint or in its run folder; pass --tokenizer")


def build_untrained() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            # use_regex=False: the split above already did the GPT-2 style splitting; this only maps
            # bytes to the 256 printable stand-in characters.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _untrained(cfg: TokenizerConfig, reserved: list[str]) -> tuple[HFTokenizer, trainers.Trainer]:
    """The untrained tokenizer of cfg.model and its trainer; `reserved` get ids 0..n-1."""
    # The tokenizers library draws its own bars (reading, counting pairs, merges) with ETAs; they
    # appear only on a terminal, and never off rank 0.
    if cfg.model == "unigram":
        return build_untrained_unigram(cfg.normalization), unigram_trainer(cfg.vocab_size, reserved, progress_visible())
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=reserved,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, even unseen ones
        show_progress=progress_visible(),
    )
    return build_untrained(), trainer


def count_documents(corpus_dir: Path) -> int:
    """Lines in the corpus's *.jsonl files: the document count up to blank lines, read at disk
    speed, which is far faster than tokenizing them. Only a progress bar's total uses it."""
    count = 0
    for path in sorted(Path(corpus_dir).glob("*.jsonl")):
        with open(path, "rb") as f:
            last = b"\n"
            while block := f.read(1 << 22):
                count += block.count(b"\n")
                last = block[-1:]
            count += last != b"\n"  # a last line without its newline
    return count


def measure_bytes_per_token(tok: Tokenizer, texts: list[str]) -> tuple[int, int]:
    if not texts:
        return 0, 0
    encoded = tok.encode_batch(texts, parse_special=False)
    return sum(len(t.encode("utf-8")) for t in texts), sum(len(ids) for ids in encoded)


def train_tokenizer(
    texts: Iterable[str], cfg: TokenizerConfig, out_dir: Path, heldout: Iterable[str], length: int | None = None
) -> dict:
    """Train on texts (up to cfg.max_train_bytes), save out_dir/tokenizer.json, measure on heldout.

    heldout is only read after training finishes, so a generator that fills it while texts is
    consumed works. length (the expected number of texts, if known) gives the progress bar its total.
    """
    cfg.validate()
    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Added first, so they get ids 0..n-1; sentinels (T5 span corruption) follow them.
    reserved = SPECIAL_TOKENS + [SENTINEL.format(k) for k in range(cfg.sentinels)]
    hf, trainer = _untrained(cfg, reserved)
    counted = {"documents": 0, "bytes": 0}

    def limited() -> Iterator[str]:
        for text in texts:
            size = len(text.encode("utf-8"))
            if cfg.max_train_bytes and counted["bytes"] + size > cfg.max_train_bytes:
                break
            counted["documents"] += 1
            counted["bytes"] += size
            if cfg.model == "unigram":  # for the error when the vocabulary cannot hold every character
                characters.update(text)
            yield from training_pieces(text)

    characters: set[str] = set()
    with rust_threads():
        try:
            hf.train_from_iterator(limited(), trainer=trainer, length=length)
        except Exception as err:  # the Rust side raises plain Exception with its message
            raise too_many_characters(err, len(characters), cfg.vocab_size) or err from None
    if cfg.model == "unigram":
        hf = with_byte_fallback(hf, reserved, cfg.normalization)
    if counted["documents"] == 0:
        raise DataError(
            f"{out_dir}: no training text for the tokenizer "
            f"(empty corpus, or max_train_bytes={cfg.max_train_bytes} below the first document)"
        )
    train_seconds = time.perf_counter() - started
    path = out_dir / "tokenizer.json"
    with publishing(path) as tmp:
        hf.save(str(tmp))
    tok = Tokenizer.load(path)
    ids = [tok.token_id(special) for special in SPECIAL_TOKENS]
    if ids != list(range(len(SPECIAL_TOKENS))):  # later stages rely on these fixed ids
        raise RuntimeError(f"special tokens got ids {ids}, expected 0..{len(SPECIAL_TOKENS) - 1}")
    heldout_bytes, heldout_tokens = measure_bytes_per_token(tok, list(heldout))
    stats = {
        "model": cfg.model,
        "vocab_size": tok.vocab_size,
        "special_tokens": len(SPECIAL_TOKENS),
        "sentinels": cfg.sentinels,
        "tokenizer_sha256": tok.sha256,
        "train_documents": counted["documents"],
        "train_bytes": counted["bytes"],
        "train_seconds": round(train_seconds, 3),
        "train_mb_per_second": round(counted["bytes"] / 1e6 / max(train_seconds, 1e-9), 3),
        "heldout_bytes": heldout_bytes,
        "heldout_tokens": heldout_tokens,
        "bytes_per_token": round(heldout_bytes / heldout_tokens, 4) if heldout_tokens else None,
        "seconds": round(time.perf_counter() - started, 3),
    }
    write_text_atomic(out_dir / "stats.json", json.dumps(stats, indent=2) + "\n")
    return stats


def reuse_tokenizer(corpus_dir: Path, cfg: TokenizerConfig, out_dir: Path) -> dict:
    """Copy the tokenizer at cfg.path into out_dir instead of training one (the token ids of an
    earlier run, for continual pretraining), measured on this corpus's held-out documents."""
    source = Path(cfg.path)
    source = source / "tokenizer.json" if source.is_dir() else source
    if not source.is_file():
        raise DataError(f"tokenizer.path: {source}: no such tokenizer.json")
    tok = Tokenizer.load(source)
    if tok.vocab_size > cfg.vocab_size:
        raise DataError(
            f"tokenizer.path: {source} has {tok.vocab_size} token ids, more than tokenizer.vocab_size={cfg.vocab_size}"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    copy_file_atomic(source, out_dir / "tokenizer.json")
    heldout_ids = choose_split_ids(corpus_dir, cfg.heldout_fraction)
    texts = [doc["text"] for doc in iter_documents(corpus_dir) if doc["id"] in heldout_ids]
    n_bytes, n_tokens = measure_bytes_per_token(tok, texts)
    stats = {
        "vocab_size": tok.vocab_size,
        "tokenizer_sha256": tok.sha256,  # the copy has the same bytes
        "reused_from": str(source),
        "heldout_documents": len(texts),
        "heldout_bytes": n_bytes,
        "heldout_tokens": n_tokens,
        "bytes_per_token": round(n_bytes / n_tokens, 4) if n_tokens else None,
    }
    write_text_atomic(out_dir / "stats.json", json.dumps(stats, indent=2) + "\n")
    return stats


def train_tokenizer_from_corpus(corpus_dir: Path, cfg: TokenizerConfig, out_dir: Path) -> dict:
    """Train on the corpus minus the held-out documents (corpus.choose_split_ids); with cfg.path,
    reuse that tokenizer instead (reuse_tokenizer)."""
    if cfg.path:
        return reuse_tokenizer(corpus_dir, cfg, out_dir)
    heldout_ids = choose_split_ids(corpus_dir, cfg.heldout_fraction)
    heldout: dict[str, list[str]] = defaultdict(list)

    def training_texts() -> Iterator[str]:
        for doc in iter_documents(corpus_dir):
            if doc["id"] in heldout_ids:
                heldout[doc["source"]].append(doc["text"])
            else:
                yield doc["text"]
        # With max_train_bytes the training pass stops early; finish collecting held-out docs.

    texts = training_texts()

    def all_heldout() -> Iterator[str]:
        for _ in texts:  # drain what training did not read, collecting the rest of the held-out set
            pass
        for source in sorted(heldout):
            yield from heldout[source]

    # Every document but the held-out ones: an upper bound when max_train_bytes stops reading early.
    length = max(count_documents(corpus_dir) - len(heldout_ids), 0) if progress_visible() else None
    stats = train_tokenizer(texts, cfg, out_dir, all_heldout(), length=length)
    tok = Tokenizer.load(Path(out_dir) / "tokenizer.json")
    per_source = {}
    for source in sorted(heldout):
        n_bytes, n_tokens = measure_bytes_per_token(tok, heldout[source])
        per_source[source] = {
            "documents": len(heldout[source]),
            "bytes": n_bytes,
            "tokens": n_tokens,
            "bytes_per_token": round(n_bytes / n_tokens, 4) if n_tokens else None,
        }
    stats["heldout_documents"] = sum(len(v) for v in heldout.values())
    stats["heldout_by_source"] = per_source
    write_text_atomic(Path(out_dir) / "stats.json", json.dumps(stats, indent=2) + "\n")
    return stats
