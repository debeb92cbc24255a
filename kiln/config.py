"""Recipes: TOML files that set the typed configs of every stage, with dotted overrides.

A recipe has one table per component (``[model]``, ``[train]``, ...). Each table fills the
dataclass that the component owns; the loader only checks names and types and then asks the
component to validate its own values, so every error names the full dotted key and the file.
"""

from __future__ import annotations

import dataclasses
import json

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.data.config import CorpusConfig, CurateConfig, PackConfig, TokenizerConfig
from kiln.errors import ConfigError
from kiln.infer.config import SampleConfig
from kiln.model.config import PRESETS, ModelConfig
from kiln.parallel.config import ParallelConfig
from kiln.peft.config import PeftConfig
from kiln.post.config import DPOConfig, GRPOConfig, SFTConfig, TaskConfig
from kiln.post.distill import DistillConfig
from kiln.post.ppo import PPOConfig
from kiln.post.rm import RMConfig
from kiln.train.config import TrainConfig

STAGES = ("corpus", "data", "tokenizer", "pack", "pretrain", "sample", "sft", "rm", "dpo", "ppo", "grpo", "distill")
POST_STAGES = ("sft", "rm", "dpo", "ppo", "grpo", "distill")


@dataclass
class RunConfig:
    name: str = "tiny"
    out_dir: str = "runs"
    stages: list[str] = field(default_factory=lambda: [s for s in STAGES if s != "data" and s not in POST_STAGES])

    def validate(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ConfigError("name", f"must be a plain folder name, got {self.name!r}")
        for stage in self.stages:
            if stage not in STAGES:
                raise ConfigError("stages", f"unknown stage {stage!r}; known: {', '.join(STAGES)}")


@dataclass
class Recipe:
    run: RunConfig = field(default_factory=RunConfig)
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    data: CurateConfig = field(default_factory=CurateConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    pack: PackConfig = field(default_factory=PackConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
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
    peft: PeftConfig = field(default_factory=PeftConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            try:
                getattr(self, f.name).validate()
            except ConfigError as err:
                raise err.within(f.name) from None
        if self.model.pos == "learned" and self.train.seq_len > self.model.max_seq_len:
            raise ConfigError("train.seq_len", f"exceeds model.max_seq_len={self.model.max_seq_len}")


def load_recipe(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a TOML recipe (or the defaults when ``path`` is None) and apply ``key=value`` overrides."""
    source = str(path) if path is not None else "<defaults>"
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError("recipe", "file not found", source) from None
        except UnicodeDecodeError as err:
            raise ConfigError("recipe", f"not UTF-8 text (byte {err.start}); TOML files are UTF-8", source) from None
        except OSError as err:
            raise ConfigError("recipe", f"cannot read: {err.strerror or err}", source) from None
        except ValueError as err:  # TOMLDecodeError, or an integer over Python's 4300-digit limit
            raise ConfigError("recipe", f"invalid TOML: {err}", source) from None
        except RecursionError:
            # tomllib parses nested arrays and inline tables recursively.
            raise ConfigError("recipe", "invalid TOML: arrays or tables nested too deeply", source) from None
    for item in overrides:
        key, value = parse_override(item)
        _set_dotted(raw, key, value)
    try:
        recipe = recipe_from_dict(raw)
        recipe.validate()
    except ConfigError as err:
        raise ConfigError(err.key, err.message, source) from None
    return recipe


def parse_override(item: str) -> tuple[str, Any]:
    """``train.lr=3e-4`` -> ("train.lr", 3e-4); values parse as TOML, else as a bare string."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or "." not in key:
        raise ConfigError(key or _show_key(item), "override must look like section.key=value", "<command line>")
    return key, parse_value(text)


def parse_value(text: str) -> Any:
    """A command-line value: TOML (``3e-4``, ``true``, ``[1, 2]``, ``"x"``), else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (ValueError, RecursionError):  # not TOML, over 4300 digits, or "[[[[..." nested too deeply
        return text  # unquoted strings such as model.preset=tiny


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(key, f"{part!r} is a value, not a table")
        tree = node
    tree[leaf] = value


def recipe_from_dict(raw: dict[str, Any]) -> Recipe:
    known = {f.name: f for f in dataclasses.fields(Recipe)}
    sections = {}
    for name, table in raw.items():
        if name not in known:
            raise ConfigError(_show_key(name), f"unknown section; known: {', '.join(known)}")
        if not isinstance(table, dict):
            raise ConfigError(name, "must be a table")
        cls = typing.get_type_hints(Recipe)[name]
        sections[name] = _build(cls, table, name)
    return Recipe(**sections)


def _build(cls: type, table: dict[str, Any], section: str, base=None):
    # Fields only: class-level constants (ClassVar) are not configurable.
    all_hints = typing.get_type_hints(cls)
    hints = {f.name: all_hints[f.name] for f in dataclasses.fields(cls)}
    base = base if base is not None else cls()
    preset_name = table.get("preset")
    if cls is ModelConfig and preset_name is not None:
        if not isinstance(preset_name, str):
            raise ConfigError(f"{section}.preset", f"expected a string, got {_kind(preset_name)} {_show(preset_name)}")
    if cls is ModelConfig and preset_name:
        if preset_name not in PRESETS:
            raise ConfigError(f"{section}.preset", f"unknown preset {preset_name!r}; known: {', '.join(PRESETS)}")
        base = dataclasses.replace(PRESETS[preset_name], preset=preset_name)
    values = {}
    for key, value in table.items():
        if key not in hints:
            raise ConfigError(f"{section}.{_show_key(key)}", f"unknown key; known: {', '.join(hints)}")
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            # A nested table overrides the enclosing default's values (e.g. [dpo.train] keeps DPO's
            # fine-tuning defaults for every key it does not set), not the nested class's own.
            values[key] = _build(hints[key], value, f"{section}.{key}", base=getattr(base, key))
        else:
            values[key] = _coerce(value, hints[key], f"{section}.{key}")
    return dataclasses.replace(base, **values)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            if option is type(None) and value is None:
                return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, option, key)
            except ConfigError as err:
                errors.append(err.message)
        raise ConfigError(key, "; ".join(errors))
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a table, got {_kind(value)}")
        return _build(hint, value, key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list, got {_kind(value)}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list) or len(value) != len(args):
            raise ConfigError(key, f"expected a list of {len(args)} values, got {_show(value)}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a table, got {_kind(value)}")
        return {str(k): _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if hint is dict:  # a free-form table, checked by its owner's validate()
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a table, got {_kind(value)}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {_kind(value)} {_show(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {_kind(value)} {_show(value)}")
        _check_int64(value, key)
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {_kind(value)} {_show(value)}")
        if isinstance(value, int):
            _check_int64(value, key)
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {_kind(value)} {_show(value)}")
        return value
    raise ConfigError(key, f"unsupported config type {hint!r}")


def _check_int64(value: int, key: str) -> None:
    # TOML integers are 64-bit and parsers must refuse what does not fit; tomllib takes any size.
    if not -(2**63) <= value <= 2**63 - 1:
        raise ConfigError(key, f"{_show(value)} is outside the 64-bit integer range TOML allows")


def _show(value: Any) -> str:
    """repr for an error message, cut short: a value can be a huge string, list or integer."""
    try:
        text = repr(value)
    except ValueError:  # an integer over Python's 4300-digit limit for str()
        return f"{_kind(value)} too large to print"
    return text if len(text) <= 80 else text[:77] + "..."


def _show_key(name: str) -> str:
    """A key as TOML would write it: bare when it can be, else quoted, so that an empty or odd
    name is visible in the error message."""
    if name and all(ch.isascii() and (ch.isalnum() or ch in "_-") for ch in name):
        return name
    return json.dumps(name, ensure_ascii=False)


def _kind(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a table",
    }.get(type(value), type(value).__name__)


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    return dataclasses.asdict(recipe)
