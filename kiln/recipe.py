"""Recipes: TOML files that set the typed configs of every stage, with dotted overrides.

A recipe has one table per component (``[model]``, ``[train]``, ...). Each table fills the
dataclass that the component owns (kiln.config builds it and checks names and types), and then
the component validates its own values, so every error names the full dotted key and the file.
The recipe sits at the top, beside the pipeline: it is the one place that knows every component.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.config import build, parse_override, read_toml, set_dotted, show_key
from kiln.data.config import CorpusConfig, CurateConfig, PackConfig, TokenizerConfig
from kiln.errors import ConfigError, did_you_mean
from kiln.infer.config import SampleConfig
from kiln.model.config import ModelConfig, arch_of, model_family
from kiln.model.t5_config import T5Config
from kiln.parallel.config import ParallelConfig
from kiln.peft.config import PeftConfig
from kiln.post.config import DistillConfig, DPOConfig, GRPOConfig, PPOConfig, RMConfig, SFTConfig, TaskConfig
from kiln.recipe_files import resolve_recipe
from kiln.storage import StorageConfig, configure, is_remote
from kiln.train.config import TrainConfig

STAGES = (
    "corpus",
    "data",
    "tokenizer",
    "pack",
    "pretrain",
    "sample",
    "sft",
    "rm",
    "dpo",
    "ppo",
    "grpo",
    "distill",
    "export",
)
POST_STAGES = ("sft", "rm", "dpo", "ppo", "grpo", "distill")
# The stages whose model the export stage can write out (the reward model is a scorer, not a
# language model), in pipeline order: by default it exports the last of them the run has.
EXPORTABLE = ("pretrain", *(s for s in POST_STAGES if s != "rm"))
EXPORT_DTYPES = ("checkpoint", "float32", "bfloat16", "float16")


@dataclass
class RunConfig:
    name: str = "tiny"
    out_dir: str = "runs"
    stages: list[str] = field(
        default_factory=lambda: [s for s in STAGES if s not in ("data", "export") and s not in POST_STAGES]
    )

    def validate(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ConfigError("name", f"must be a plain folder name, got {self.name!r}")
        for stage in self.stages:
            if stage not in STAGES:
                raise ConfigError(
                    "stages", f"unknown stage {stage!r}{did_you_mean(stage, STAGES)}; known: {', '.join(STAGES)}"
                )


@dataclass
class ExportConfig:
    """`[export]`: the export stage writes a model of the run as a transformers folder into
    <run>/export/. It lives here, not in kiln/hf.py, because its `source` is a stage of the run."""

    source: str = "auto"  # auto: the last of EXPORTABLE in run.stages; else one of them by name
    dtype: str = "checkpoint"  # the tensors' dtype in model.safetensors; checkpoint: as trained and saved

    def validate(self) -> None:
        if self.source != "auto" and self.source not in EXPORTABLE:
            raise ConfigError("source", f"must be auto or a model stage ({', '.join(EXPORTABLE)}), got {self.source!r}")
        if self.dtype not in EXPORT_DTYPES:
            raise ConfigError("dtype", f"must be one of {', '.join(EXPORT_DTYPES)}, got {self.dtype!r}")


def export_source(recipe: Recipe) -> str:
    """The stage whose model the export stage writes: [export] source, or the run's last model stage.
    A ConfigError names run.stages (or export.source) when the run has no such stage."""
    if recipe.export.source != "auto":
        if recipe.export.source not in recipe.run.stages:
            raise ConfigError(
                "export.source",
                f"names {recipe.export.source!r}, which run.stages ({', '.join(recipe.run.stages)}) does not run",
            )
        return recipe.export.source
    models = [s for s in recipe.run.stages if s in EXPORTABLE]
    if not models:
        raise ConfigError(
            "run.stages",
            f"export has nothing to export: the run trains no model ({', '.join(EXPORTABLE)}); "
            f"add one before export or remove export",
        )
    return max(models, key=STAGES.index)


@dataclass
class Recipe:
    run: RunConfig = field(default_factory=RunConfig)
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    data: CurateConfig = field(default_factory=CurateConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    pack: PackConfig = field(default_factory=PackConfig)
    model: ModelConfig = field(default_factory=ModelConfig)  # or BertConfig / T5Config: [model] arch picks
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    tasks: TaskConfig = field(default_factory=TaskConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)

    @property
    def run_dir(self) -> Path:
        """The local run folder; a remote run.out_dir is `kiln run`'s alone (kiln/run_store.py)."""
        if is_remote(self.run.out_dir):
            raise ConfigError(
                "run.out_dir", f"{self.run.out_dir}: this command writes a local run folder; use a local path"
            )
        return Path(self.run.out_dir) / self.run.name

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            try:
                getattr(self, f.name).validate()
            except ConfigError as err:
                raise err.within(f.name) from None
        if getattr(self.model, "pos", None) == "learned" and self.train.seq_len > self.model.max_seq_len:
            raise ConfigError("train.seq_len", f"exceeds model.max_seq_len={self.model.max_seq_len}")
        if arch_of(self.model) != "decoder":
            generative = [s for s in self.run.stages if s == "sample" or s in POST_STAGES]
            if generative:
                raise ConfigError(
                    "run.stages",
                    f"{', '.join(generative)} need a decoder; model.arch = {arch_of(self.model)!r} runs "
                    f"corpus, data, tokenizer, pack and pretrain",
                )
        for name in (s for s in self.run.stages if s in POST_STAGES):
            try:  # the stage's keys over [train]'s: a combination neither section can judge alone
                getattr(self, name).train.train_config(self.train).validate()
            except ConfigError as err:
                raise ConfigError(f"{name}.train", f"with [train]'s other keys, {err.key}: {err.message}") from None
        if isinstance(self.model, T5Config):
            self._validate_t5()
        if "export" in self.run.stages:
            export_source(self)  # refused before any stage runs when there is nothing to export

    def _validate_t5(self) -> None:
        """What a T5 run cannot do yet, refused by key before any stage starts."""
        for key in ("tp", "pp", "cp", "ep"):
            if getattr(self.parallel, key) != 1:
                raise ConfigError(f"parallel.{key}", 'must be 1 with [model] arch = "t5" (T5 trains on one process)')
        if self.train.activation_checkpointing != "none":
            raise ConfigError("train.activation_checkpointing", 'is not supported with [model] arch = "t5"')


def load_recipe(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a TOML recipe (or the defaults when ``path`` is None) and apply ``key=value`` overrides."""
    source = str(path) if path is not None else "<defaults>"
    raw: dict[str, Any] = read_toml(resolve_recipe(path)) if path is not None else {}
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    try:
        recipe = recipe_from_dict(raw)
        recipe.validate()
    except ConfigError as err:
        raise ConfigError(err.key, err.message, source) from None
    configure(recipe.storage.options())  # every fsspec URL the stages open uses them
    return recipe


def recipe_from_dict(raw: dict[str, Any]) -> Recipe:
    known = {f.name: f for f in dataclasses.fields(Recipe)}
    sections = {}
    for name, table in raw.items():
        if name not in known:
            raise ConfigError(show_key(name), f"unknown section{did_you_mean(name, known)}; known: {', '.join(known)}")
        if not isinstance(table, dict):
            raise ConfigError(name, "must be a table")
        cls = typing.get_type_hints(Recipe)[name]
        if name == "model":  # `arch` picks the family's config class (the decoder's by default)
            try:
                cls, table = model_family(table)
            except ConfigError as err:
                raise err.within(name) from None
        sections[name] = build(cls, table, name)
    return Recipe(**sections)


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    return dataclasses.asdict(recipe)
