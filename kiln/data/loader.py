"""Resumable, rank-aware loader of fixed-length token windows from packed shards.

Windows: a shard of n tokens holds (n - 1) // T windows of T + 1 tokens, window i being
tokens[i*T : i*T + T + 1]; x is its first T tokens and y its last T. Consecutive windows share one
token, so no token is wasted except the < T + 1 left at the end of each shard, and documents run
across window boundaries separated by <|endoftext|> (as in GPT-2/nanoGPT-style pretraining).

Train split (infinite):
- Global sequence g (counted across all ranks) takes its source from a counter-based hash of
  (seed, g) against the mixture weights, so the choice needs no RNG state to be saved.
- Each source walks its windows in a permutation seeded by (seed, source, epoch), reshuffled
  every epoch of that source.
- A global batch is batch_size * world_size consecutive sequences; rank r takes sequences
  [r*batch_size, (r+1)*batch_size) of it. Every rank advances the same global state, so
  ``state_dict()`` is identical on all ranks and also resumes on a different world size with the
  same global batch.

Val split (finite, no shuffling): all windows of all sources, interleaved in proportion to each
source's window count (so any stretch of the order samples every source), cut into global batches,
the incomplete last one dropped. ``next()`` walks them once then raises StopIteration; ``reset()``
rewinds; ``iter_batches(n)`` yields the first n batches (fewer if there are fewer) from the start
every time, without touching the cursor.

``validation_batches(limit)`` is what the training loop evaluates: every window of the split once
(limit 0), or a fixed sample of limit global batches' worth spread over the whole order
(``spread_sample``): the same windows at every evaluation, after a resume and in every run on the
same pack with the same global batch.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from kiln import storage
from kiln.data.remote_pack import local_pack
from kiln.errors import ConfigError, DataError

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
HEADER_KEYS = ("dtype", "vocab_size", "tokenizer_sha256", "documents", "tokens", "bytes", "source")
STATE_VERSION = 1
# The validation sample depends on the split and the budget only, not on train.seed: runs that differ
# in their seed (or in any other setting) are measured on the same windows.
VALIDATION_SAMPLE_SEED = 0x5EED


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash of each element (SplitMix64 finaliser); wraps mod 2**64."""
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def uniform_for_counters(seed: int, counters: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) numbers that depend only on (seed, counter): random access, no state."""
    key = splitmix64(np.array([seed], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        mixed = splitmix64(counters.astype(np.uint64) ^ key)
    return (mixed >> np.uint64(11)).astype(np.float64) / float(2**53)


def spread_sample(count: int, k: int, seed: int = VALIDATION_SAMPLE_SEED) -> np.ndarray:
    """k sorted indices of range(count), one drawn from each of k equal consecutive strata (all of
    them if k is 0 or >= count): every part of the range is represented, and the draw depends only on
    (count, k, seed), so it is the same every time it is asked for."""
    if k <= 0 or k >= count:
        return np.arange(count)
    edges = np.arange(k + 1, dtype=np.int64) * count // k  # count > k: no stratum is empty
    offsets = uniform_for_counters(seed, np.arange(k)) * (edges[1:] - edges[:-1])
    return edges[:-1] + offsets.astype(np.int64)


def rank_batches(
    positions: np.ndarray, batch_size: int, rank: int, world_size: int, row_multiple: int = 1
) -> Iterator[np.ndarray]:
    """This rank's share of `positions` as batches: its slice of each global batch of
    batch_size * world_size, then its equal slice of the rest. Every rank gets the same number of
    batches of the same sizes (sharded models run collectives in every forward); the tail slice is a
    multiple of row_multiple (a pipeline's microbatch count), so under world_size > 1 or
    row_multiple > 1 fewer than world_size * row_multiple positions can be left out."""
    global_batch = batch_size * world_size
    full = len(positions) // global_batch
    for b in range(full):
        start = b * global_batch + rank * batch_size
        yield positions[start : start + batch_size]
    rest = positions[full * global_batch :]
    share = len(rest) // world_size // row_multiple * row_multiple
    if share:
        yield rest[rank * share : (rank + 1) * share]


class SourceWindows:
    """The windows of one source in one split, spread over its shards."""

    def __init__(self, name: str, shards: list[np.ndarray], seq_len: int):
        self.name = name
        self.shards = shards
        self.seq_len = seq_len
        counts = [max(0, (len(s) - 1) // seq_len) for s in shards]
        self.starts = np.cumsum([0] + counts)  # first global window index of each shard
        self.count = int(self.starts[-1])

    def window(self, index: int) -> np.ndarray:
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        local = index - int(self.starts[shard])
        start = local * self.seq_len
        return self.shards[shard][start : start + self.seq_len + 1]


def read_headers(split_dir: Path) -> list[tuple[Path, dict]]:
    headers = []
    for path in sorted(split_dir.glob("*.json")):
        try:
            header = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise DataError(f"{path}: unreadable shard header ({err})") from None
        missing = [k for k in HEADER_KEYS if k not in header] if isinstance(header, dict) else list(HEADER_KEYS)
        if missing:
            raise DataError(f"{path}: shard header lacks {', '.join(missing)}")
        if header["dtype"] not in DTYPES:
            raise DataError(f"{path}: dtype {header['dtype']!r} is not one of {', '.join(DTYPES)}")
        headers.append((path, header))
    return headers


class TokenLoader:
    def __init__(
        self,
        pack_dir: str | Path,
        split: str = "train",
        seq_len: int = 256,
        batch_size: int = 8,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        mixture: dict[str, float] | None = None,
    ):
        for key, value in (("seq_len", seq_len), ("batch_size", batch_size), ("world_size", world_size)):
            if value <= 0:
                raise ConfigError(key, f"must be positive, got {value}")
        if seed < 0:  # seeds feed unsigned hashes and numpy's SeedSequence
            raise ConfigError("seed", f"must be >= 0, got {seed}")
        if not 0 <= rank < world_size:
            raise ConfigError("rank", f"must be in [0, world_size={world_size}), got {rank}")
        if split not in ("train", "val"):
            raise ConfigError("split", f"must be 'train' or 'val', got {split!r}")
        # A pack on an object store is read from its verified local copy (memory-mapped shards).
        self.pack_dir = local_pack(pack_dir) if storage.is_remote(pack_dir) else Path(pack_dir)
        self.split, self.seq_len, self.batch_size = split, seq_len, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.global_batch = batch_size * world_size
        self._load_shards()
        if split == "train":
            self._init_train(mixture)
        else:
            self._init_val()

    # ---- shards and headers ----------------------------------------------------------------

    def _load_shards(self) -> None:
        split_dir = self.pack_dir / self.split
        headers = read_headers(split_dir) if split_dir.is_dir() else []
        if not headers:
            raise DataError(f"{split_dir}: no token shards (<source>-00000.bin + .json); run the pack stage first")
        first_path, first = headers[0]
        mixture_path = self.pack_dir / "mixture.json"
        self.mixture_file: dict = {}
        if mixture_path.is_file():
            try:
                self.mixture_file = json.loads(mixture_path.read_text())
            except json.JSONDecodeError as err:
                raise DataError(f"{mixture_path}: invalid JSON ({err.msg})") from None
            if self.mixture_file.get("tokenizer_sha256") != first["tokenizer_sha256"]:
                raise DataError(
                    f"{mixture_path}: tokenizer_sha256 differs from {first_path}'s; "
                    f"the pack folder mixes outputs of different tokenizers"
                )
        by_source: dict[str, list[np.ndarray]] = {}
        tokens = bytes_ = 0
        for path, header in headers:
            for key in ("tokenizer_sha256", "dtype", "vocab_size"):
                if header[key] != first[key]:
                    raise DataError(
                        f"{path}: {key} {header[key]!r} differs from {first_path.name}'s "
                        f"{first[key]!r}; shards of different tokenizers cannot be mixed"
                    )
            bin_path = path.with_suffix(".bin")
            dtype = DTYPES[header["dtype"]]
            expected = header["tokens"] * dtype.itemsize
            size = bin_path.stat().st_size if bin_path.is_file() else -1
            if size != expected:
                raise DataError(
                    f"{bin_path}: {'missing' if size < 0 else f'{size} bytes'}, header says "
                    f"{header['tokens']} {header['dtype']} tokens = {expected} bytes"
                )
            data = np.memmap(bin_path, dtype=dtype, mode="r") if expected else np.zeros(0, dtype)
            by_source.setdefault(header["source"], []).append(data)
            tokens += header["tokens"]
            bytes_ += header["bytes"]
        self.vocab_size: int = first["vocab_size"]
        self.tokenizer_sha256: str = first["tokenizer_sha256"]
        # Bytes of text per token of this split (end-of-document tokens included): loss in nats
        # per token / bytes_per_token / ln 2 = bits per byte, comparable across tokenizers.
        self.bytes_per_token: float = bytes_ / tokens if tokens else 0.0
        self.sources = {name: SourceWindows(name, shards, self.seq_len) for name, shards in sorted(by_source.items())}

    # ---- train: weighted mixing, per-source epochs ------------------------------------------

    def _init_train(self, mixture: dict[str, float] | None) -> None:
        weights = mixture if mixture is not None else self.mixture_file.get("weights")
        if weights is None:
            weights = {name: float(s.count) for name, s in self.sources.items()}
        for name, weight in weights.items():
            if name not in self.sources:
                raise ConfigError(
                    f"mixture.{name}",
                    f"no such source in {self.pack_dir / self.split}; sources: {', '.join(self.sources)}",
                )
            if weight < 0:
                raise ConfigError(f"mixture.{name}", f"must be >= 0, got {weight}")
            if weight > 0 and self.sources[name].count == 0:
                raise DataError(
                    f"{self.pack_dir / self.split}: source {name!r} has weight {weight} but fewer "
                    f"than seq_len+1={self.seq_len + 1} tokens per shard; give it weight 0 "
                    f"(pack.mixture.{name}) or use a shorter seq_len"
                )
        total = sum(weights.values())
        if total <= 0:
            raise ConfigError("mixture", "weights must not all be zero")
        self.weights = {name: weights[name] / total for name in sorted(weights) if weights[name] > 0}
        self._names = list(self.weights)
        self._cumulative = np.cumsum([self.weights[n] for n in self._names])
        self._cumulative[-1] = 1.0  # guard against rounding leaving u in (sum, 1)
        self.sequences = 0  # global sequences drawn so far, all ranks
        self.cursors = {name: 0 for name in self._names}  # windows drawn so far per source
        self._perms: dict[str, tuple[int, np.ndarray]] = {}

    def _permutation(self, name: str, epoch: int) -> np.ndarray:
        cached = self._perms.get(name)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([self.seed, zlib.crc32(name.encode()), epoch])
            cached = (epoch, rng.permutation(self.sources[name].count))
            self._perms[name] = cached
        return cached[1]

    def _next_train(self) -> list[np.ndarray]:
        return self.draw(self.global_batch, range(self.rank * self.batch_size, (self.rank + 1) * self.batch_size))

    def draw(self, count: int, mine) -> list[np.ndarray]:
        """Advance the train stream by `count` global sequences and return the windows of those whose
        offset (0-based, within the count) is in `mine`: every rank advances every cursor, but reads
        only its own. A whole global batch is _next_train; kiln.data.replay draws shares of one."""
        counters = np.arange(self.sequences, self.sequences + count, dtype=np.uint64)
        picks = np.searchsorted(self._cumulative, uniform_for_counters(self.seed, counters), side="right")
        windows = []
        for j, pick in enumerate(picks):
            name = self._names[int(pick)]
            drawn = self.cursors[name]
            self.cursors[name] = drawn + 1
            if j in mine:
                source = self.sources[name]
                windows.append(source.window(int(self._permutation(name, drawn // source.count)[drawn % source.count])))
        self.sequences += count
        return windows

    # ---- val: fixed interleaved order ------------------------------------------------------

    def _init_val(self) -> None:
        names, indices, keys = [], [], []
        for k, source in enumerate(self.sources.values()):
            names.append(np.full(source.count, k))
            indices.append(np.arange(source.count))
            # Window j of a source with n windows sits at (j + 0.5) / n on a shared line, which
            # spreads every source evenly through the order.
            keys.append((np.arange(source.count) + 0.5) / max(source.count, 1))
        order = np.lexsort((np.concatenate(names), np.concatenate(keys)))
        self._val_source = np.concatenate(names)[order]
        self._val_index = np.concatenate(indices)[order]
        self._source_list = list(self.sources.values())
        self.num_batches = len(order) // self.global_batch
        if self.num_batches == 0:
            raise DataError(
                f"{self.pack_dir / self.split}: {len(order)} windows of seq_len+1={self.seq_len + 1} "
                f"tokens, fewer than one global batch of {self.global_batch}"
            )
        self.next_batch = 0

    def _val_windows(self, positions) -> list[np.ndarray]:
        """The windows at these positions of the interleaved val order."""
        return [self._source_list[int(self._val_source[i])].window(int(self._val_index[i])) for i in positions]

    def _val_batch(self, b: int) -> list[np.ndarray]:
        start = b * self.global_batch + self.rank * self.batch_size
        return self._val_windows(range(start, start + self.batch_size))

    def reset(self) -> None:
        if self.split != "val":
            raise ValueError("reset() rewinds the val split; the train split resumes via load_state_dict")
        self.next_batch = 0

    # ---- iteration -------------------------------------------------------------------------

    @staticmethod
    def _to_tensors(windows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = torch.from_numpy(np.stack(windows).astype(np.int64))
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def __iter__(self) -> "TokenLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.split == "train":
            return self._to_tensors(self._next_train())
        if self.next_batch >= self.num_batches:
            raise StopIteration
        self.next_batch += 1
        return self._to_tensors(self._val_batch(self.next_batch - 1))

    def iter_batches(self, n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """val: the first n batches from the start, every call (cursor untouched).
        train: the next n batches (advances the state like next())."""
        if self.split == "train":
            for _ in range(n):
                yield next(self)
            return
        for b in range(min(n, self.num_batches)):
            yield self._to_tensors(self._val_batch(b))

    def validation_batches(self, limit: int = 0, row_multiple: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """val: this rank's batches of the evaluation set: every window of the split once (limit
        0), else spread_sample's limit * global_batch windows; see rank_batches for the tail."""
        if self.split != "val":
            raise ValueError("validation_batches() reads the val split")
        positions = spread_sample(len(self._val_source), limit * self.global_batch)
        for chunk in rank_batches(positions, self.batch_size, self.rank, self.world_size, row_multiple):
            yield self._to_tensors(self._val_windows(chunk))

    # ---- resume ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        state = {
            "version": STATE_VERSION,
            "split": self.split,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "tokenizer_sha256": self.tokenizer_sha256,
        }
        if self.split == "train":
            state.update(sequences=self.sequences, cursors=dict(self.cursors), weights=dict(self.weights))
        else:
            state.update(next_batch=self.next_batch, global_batch=self.global_batch)
        return state

    def load_state_dict(self, state: dict) -> None:
        if "replay_fraction" in state:  # kiln.data.replay's state: two packs' positions
            raise DataError(
                "loader state is of a run with train.replay; resuming without it would not continue the same stream"
            )
        mine = self.state_dict()
        for key in ("version", "split", "seq_len", "seed", "tokenizer_sha256"):
            if state.get(key) != mine[key]:
                raise DataError(
                    f"loader state has {key}={state.get(key)!r} but this loader has {mine[key]!r}; "
                    f"it belongs to a different run or data"
                )
        if self.split == "train":
            if state["weights"] != mine["weights"]:
                raise DataError(
                    f"loader state has mixture weights {state['weights']} but this loader has "
                    f"{mine['weights']}; resuming would not continue the same stream"
                )
            self.sequences = int(state["sequences"])
            self.cursors = {name: int(state["cursors"][name]) for name in self._names}
        else:
            if state["global_batch"] != self.global_batch:
                raise DataError(
                    f"val loader state was for global batch {state['global_batch']}, "
                    f"this loader has {self.global_batch}"
                )
            self.next_batch = int(state["next_batch"])
