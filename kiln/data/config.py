"""Configs of the data stages: corpus building, tokenizer training and packing."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field

from kiln.config import build
from kiln.data.fields import FieldMap
from kiln.data.steps import STEPS, build_step
from kiln.data.warc import DEFAULT_EXTRACTOR, check_extractor
from kiln.errors import ConfigError, did_you_mean

BUILTIN_SOURCES = ("python_stdlib", "python_docs", "debian_docs")


@dataclass
class CorpusConfig:
    sources: list[str] = field(default_factory=lambda: list(BUILTIN_SOURCES))
    max_bytes_per_source: int = 6_000_000  # keeps the CPU demo within its time budget
    min_chars: int = 64  # shorter documents carry almost no signal
    max_chars: int = 32_000  # longer files are split at line boundaries
    seed: int = 0

    def validate(self) -> None:
        if not self.sources:
            raise ConfigError("sources", "must name at least one source")
        for name in self.sources:
            if name not in BUILTIN_SOURCES:
                raise ConfigError("sources", f"unknown source {name!r}; known: {', '.join(BUILTIN_SOURCES)}")
        if self.max_bytes_per_source <= 0:
            raise ConfigError("max_bytes_per_source", f"must be positive, got {self.max_bytes_per_source}")
        if not 0 < self.min_chars < self.max_chars:
            raise ConfigError("min_chars", f"must satisfy 0 < min_chars < max_chars={self.max_chars}")


MIN_FREQUENCY = 2
TOKENIZER_MODELS = ("bpe", "unigram")  # kiln.data.tokenizer, kiln.data.unigram
NORMALIZATIONS = ("none", "nfkc")


@dataclass
class TokenizerConfig:
    model: str = "bpe"  # "bpe" (byte-level BPE) or "unigram" (SentencePiece-style, byte fallback)
    vocab_size: int = 8192
    min_frequency: int = MIN_FREQUENCY  # BPE only
    normalization: str = "none"  # unigram only: "none" or "nfkc" (lossy, docs/data.md#unigram)
    heldout_fraction: float = 0.02  # documents kept out of training to measure bytes per token
    max_train_bytes: int = 0  # 0: train on the whole corpus
    sentinels: int = 0  # <|sentinel_k|> tokens after the fixed special ones, for T5 span corruption
    # An existing tokenizer (tokenizer.json, or a folder holding it) used instead of training one:
    # continual pretraining keeps the earlier run's token ids (docs/continual.md).
    path: str = ""

    def validate(self) -> None:
        if self.path:
            trained = (
                ("min_frequency", 2),
                ("max_train_bytes", 0),
                ("sentinels", 0),
                ("model", "bpe"),
                ("normalization", "none"),
            )
            for key, default in trained:
                if getattr(self, key) != default:
                    raise ConfigError(key, f"trains a tokenizer, but path = {self.path!r} uses an existing one")
        # 256 byte symbols plus the reserved special tokens must fit before any merge.
        if self.vocab_size < 512:
            raise ConfigError("vocab_size", f"must be at least 512, got {self.vocab_size}")
        if not 0 <= self.sentinels <= self.vocab_size - 512:
            raise ConfigError(
                "sentinels", f"must be in 0..vocab_size - 512 = {self.vocab_size - 512}, got {self.sentinels}"
            )
        self._check_model_keys()
        if self.min_frequency < 1:
            raise ConfigError("min_frequency", f"must be >= 1, got {self.min_frequency}")
        if not 0 < self.heldout_fraction < 0.5:
            raise ConfigError("heldout_fraction", f"must be in (0, 0.5), got {self.heldout_fraction}")

    def _check_model_keys(self) -> None:
        """Refuse a key the chosen model does not use."""
        if self.model not in TOKENIZER_MODELS:
            raise ConfigError("model", f"must be one of {', '.join(TOKENIZER_MODELS)}, got {self.model!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError(
                "normalization", f"must be one of {', '.join(NORMALIZATIONS)}, got {self.normalization!r}"
            )
        if self.model == "bpe" and self.normalization != "none":
            raise ConfigError("normalization", 'applies to model = "unigram" only (byte-level BPE keeps text as is)')
        if self.model == "unigram" and self.min_frequency != MIN_FREQUENCY:
            raise ConfigError("min_frequency", 'is a BPE merge threshold; model = "unigram" has none (leave it unset)')


@dataclass
class PackConfig:
    val_fraction: float = 0.01  # documents (by stable hash of id) held out for validation
    # fewest validation documents: a smaller split is widened to this (at most half the corpus), with
    # a warning, because a loss over a handful of documents is mostly noise; 0: off
    min_val_docs: int = 20
    mixture: dict[str, float] = field(default_factory=dict)  # source -> weight; empty: by token count
    shard_tokens: int = 16_777_216  # tokens per shard file

    def validate(self) -> None:
        if not 0 < self.val_fraction < 0.5:
            raise ConfigError("val_fraction", f"must be in (0, 0.5), got {self.val_fraction}")
        for name, weight in self.mixture.items():
            if weight < 0:
                raise ConfigError(f"mixture.{name}", f"must be >= 0, got {weight}")
        if self.mixture and sum(self.mixture.values()) <= 0:
            raise ConfigError("mixture", "weights must not all be zero")
        if self.min_val_docs < 0:
            raise ConfigError("min_val_docs", f"must be >= 0, got {self.min_val_docs}")
        if self.shard_tokens <= 0:
            raise ConfigError("shard_tokens", f"must be positive, got {self.shard_tokens}")


# The default chain: cheap normalisation and language ID first, then the heuristic filters, then
# deduplication (exact before fuzzy, so MinHash sees fewer documents), PII scrubbing last so that
# dedup compares the original text.
DEFAULT_STEPS = [
    "normalize",
    "langid",
    "gopher_quality",
    "gopher_repetition",
    "fineweb",
    "exact_dedup",
    "minhash_dedup",
    "pii",
]


EXECUTORS = ("local", "ray", "slurm")
_SLURM_TIME = re.compile(r"^\d+(-\d{1,2}(:\d{2}){0,2}|(:\d{2}){0,2})$")  # M, M:S, H:M:S, D-H, D-H:M, D-H:M:S


@dataclass
class SlurmDataOptions:
    """[data.slurm]: how the curation's job arrays are asked for (executor = "slurm" only)."""

    job_name: str = "kiln-data"  # each job is <job_name>-<what>, e.g. kiln-data-phase-0
    partition: str = ""
    account: str = ""
    qos: str = ""
    time: str = ""  # per array task, D-HH:MM:SS; empty: the partition's default limit
    cpus_per_task: int = 1  # a curation task is one process
    mem: str = ""  # per array task, e.g. 4G; empty: the partition's default
    tasks_per_job: int = 1  # curation tasks (shards) run one after another by one array task
    max_array_size: int = 1001  # Slurm's MaxArraySize: a bigger phase is several arrays
    sbatch_args: list[str] = field(default_factory=list)  # extra #SBATCH lines, e.g. "--constraint=cpu"
    setup: list[str] = field(default_factory=list)  # shell lines run first (module load, venv)
    python: str = "python"  # the interpreter with Kiln installed, as the nodes see it
    dry_run: bool = False  # write the scripts and print the sbatch commands; submit nothing

    def validate(self) -> None:
        if self.time and not _SLURM_TIME.match(self.time):
            raise ConfigError("slurm.time", f"must look like MM, HH:MM:SS or D-HH:MM:SS, got {self.time!r}")
        for key in ("cpus_per_task", "tasks_per_job", "max_array_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"slurm.{key}", f"must be >= 1, got {getattr(self, key)}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.job_name):
            raise ConfigError("slurm.job_name", f"must be letters, digits, '.', '_' or '-', got {self.job_name!r}")
        for i, arg in enumerate(self.sbatch_args):
            if not arg.startswith("--") or "\n" in arg:
                raise ConfigError(f"slurm.sbatch_args[{i}]", f"must be one long sbatch option, got {arg!r}")
        if not self.python.strip():
            raise ConfigError("slurm.python", "must name the interpreter, e.g. .venv/bin/python")


@dataclass
class CurateConfig:
    # Files, folders or globs, each a string or a table {path = ..., preset/text_key/id_key/
    # source_key/meta_keys = ...} saying which record fields make the document; empty: the run's corpus.
    inputs: list[str | dict] = field(default_factory=list)
    steps: list[str] = field(default_factory=lambda: list(DEFAULT_STEPS))
    params: dict = field(default_factory=dict)  # [data.params.<step>] tables: each step's fields
    tasks: int = 4  # shards of work; the unit of resumption
    workers: int = 2  # processes running tasks in parallel (local executor)
    executor: str = "local"  # "local" (worker processes), "ray" (pip install 'kiln[ray]') or "slurm"
    ray_address: str = ""  # "": start Ray here; "auto", "host:6379", "ray://host:10001": join
    slurm: SlurmDataOptions = field(default_factory=SlurmDataOptions)  # executor = "slurm" only
    html_extractor: str = DEFAULT_EXTRACTOR  # main text of WARC inputs' HTML: "resiliparse" or "trafilatura"
    # true: when the one input, a local .warc.gz, does not exist yet, build it first from the HTML of
    # Debian's documentation packages (kiln.data.warc_demo), so the crawl demo runs from a clean clone.
    demo_crawl: bool = False

    def input_specs(self) -> list[tuple[str, FieldMap | None]]:
        """(path, field map) per input; None for a plain-string input (the default fields)."""
        specs = []
        for i, entry in enumerate(self.inputs):
            if isinstance(entry, str):
                specs.append((entry, None))
                continue
            key = f"inputs[{i}]"
            table = dict(entry)
            path = table.pop("path", None)
            if not isinstance(path, str) or not path:
                raise ConfigError(f"{key}.path", 'each input table needs path = "<file, folder or glob>"')
            fields = build(FieldMap, table, key)
            try:
                fields.validate()
            except ConfigError as err:
                raise err.within(key) from None
            specs.append((path, fields))
        return specs

    def validate(self) -> None:
        self.input_specs()
        if self.tasks <= 0:
            raise ConfigError("tasks", f"must be positive, got {self.tasks}")
        if self.workers <= 0:
            raise ConfigError("workers", f"must be positive, got {self.workers}")
        if self.executor not in EXECUTORS:
            raise ConfigError("executor", f"must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        if self.executor == "ray" and importlib.util.find_spec("ray") is None:
            # Fail at recipe load, not after the stages before `data` have run.
            raise ConfigError("executor", "\"ray\" needs Ray installed: pip install 'kiln[ray]'")
        if self.executor != "slurm" and self.slurm != SlurmDataOptions():
            raise ConfigError("slurm", f'applies to executor = "slurm" only, not {self.executor!r}')
        if self.executor != "ray" and self.ray_address:
            raise ConfigError("ray_address", f'applies to executor = "ray" only, not {self.executor!r}')
        self.slurm.validate()
        for name in self.steps:
            # The bad value is in steps, so the error names that key (build_step would name the
            # params table of a step that does not exist).
            if name not in STEPS:
                raise ConfigError(
                    "steps", f"unknown step {name!r}{did_you_mean(name, STEPS)}; known: {', '.join(sorted(STEPS))}"
                )
        check_extractor(self.html_extractor, installed=False)  # installed: checked once WARC inputs are listed
        if self.demo_crawl and not (
            len(self.inputs) == 1
            and isinstance(self.inputs[0], str)
            and self.inputs[0].endswith(".warc.gz")
            and "://" not in self.inputs[0]
        ):
            raise ConfigError(
                "demo_crawl", f"builds one local .warc.gz: data.inputs must be that one path, got {self.inputs}"
            )
        for name in self.params:
            if name not in self.steps:
                raise ConfigError(f"params.{name}", f"configures a step that is not in steps {self.steps}")
        self.build_steps()

    def build_steps(self) -> list:
        return [build_step(name, self.params.get(name, {}), f"params.{name}") for name in self.steps]
