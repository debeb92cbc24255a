"""Tokenizer compression: byte-level BPE vs unigram (tokenizer.model) at the same vocabulary size.

Both are trained by kiln.data.tokenizer.train_tokenizer_from_corpus on the same built-in corpus and
measured on the same held-out documents (the tokenizer stage's own split), per source: UTF-8 bytes
per token and tokens per whitespace-separated word. Chinese text from the fortunes-zh package
(/usr/share/games/fortunes/chinese, or --chinese PATH) is measured too when present; it is not
in the training text, so it shows how each model copes with script it has not seen.

    python bench/tokenizer_compression.py
    python bench/tokenizer_compression.py --vocab-size 8192 --max-bytes-per-source 2000000
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from machine import cpu_line  # bench/ (the script's folder, on sys.path)

from kiln.data.config import TOKENIZER_MODELS, CorpusConfig, TokenizerConfig
from kiln.data.corpus import build_corpus, choose_split_ids, iter_documents
from kiln.data.tokenizer import Tokenizer, train_tokenizer_from_corpus

CHINESE = Path("/usr/share/games/fortunes/chinese")


def heldout_texts(corpus_dir: Path, fraction: float) -> dict[str, list[str]]:
    """The documents the tokenizer stage keeps out of training, by source."""
    ids = choose_split_ids(corpus_dir, fraction)
    out: dict[str, list[str]] = defaultdict(list)
    for doc in iter_documents(corpus_dir):
        if doc["id"] in ids:
            out[doc["source"]].append(doc["text"])
    return dict(out)


def fortunes(path: Path) -> list[str]:
    """The entries of a fortune file (separated by lines holding only "%")."""
    text = path.read_text(encoding="utf-8", errors="strict")
    return [entry.strip("\n") for entry in text.split("\n%\n") if entry.strip()]


def measure(tok: Tokenizer, texts: list[str]) -> dict:
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(ids) for ids in tok.encode_batch(texts, parse_special=False))
    words = sum(len(t.split()) for t in texts)
    chars = sum(len(t) for t in texts)
    return {
        "bytes": n_bytes,
        "tokens": n_tokens,
        "bytes_per_token": n_bytes / n_tokens,
        "tokens_per_word": n_tokens / max(words, 1),
        "tokens_per_char": n_tokens / chars,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--max-bytes-per-source", type=int, default=2_000_000)
    parser.add_argument("--chinese", type=Path, default=CHINESE)
    parser.add_argument(
        "--work", type=Path, default=None, help="folder for corpus and tokenizers (default: a temp dir)"
    )
    args = parser.parse_args()
    print(cpu_line(), flush=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="kiln-tok-bench-"))
    corpus = work / "corpus"
    build_corpus(CorpusConfig(max_bytes_per_source=args.max_bytes_per_source), corpus)
    sets = heldout_texts(corpus, TokenizerConfig().heldout_fraction)
    if args.chinese.is_file():
        sets["chinese (fortunes-zh, unseen)"] = fortunes(args.chinese)
    else:
        print(f"({args.chinese} not found: no Chinese row; apt install fortunes-zh to add it)")
    rows = []
    for model in TOKENIZER_MODELS:
        started = time.perf_counter()
        stats = train_tokenizer_from_corpus(
            corpus, TokenizerConfig(model=model, vocab_size=args.vocab_size), work / model
        )
        seconds = time.perf_counter() - started
        tok = Tokenizer.load(work / model)
        for name, texts in sets.items():
            rows.append((name, model, len(texts), measure(tok, texts)))
        print(f"{model}: trained on {stats['train_bytes'] / 1e6:.1f} MB in {seconds:.1f} s, vocab {tok.vocab_size}")
    print(f"\nvocab_size {args.vocab_size}, corpus.max_bytes_per_source {args.max_bytes_per_source}")
    print("| held-out text | model | docs | bytes | tokens | bytes/token | tokens/word | tokens/char |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, model, docs, m in sorted(rows, key=lambda r: (r[0], r[1])):
        print(
            f"| {name} | {model} | {docs} | {m['bytes']} | {m['tokens']} | {m['bytes_per_token']:.3f} "
            f"| {m['tokens_per_word']:.3f} | {m['tokens_per_char']:.3f} |"
        )


if __name__ == "__main__":
    main()
