"""Typed configs from TOML: the machinery every component's config goes through.

A component owns a small dataclass; `build` fills it from a TOML table, checking names and types
and naming the full dotted key in every error, and the component's own `validate()` checks the
values. The recipe (kiln.recipe) is one such dataclass with a table per component; overrides such
as ``train.lr=3e-4`` parse here too. This module is the bottom layer: it imports no component.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib
import types
import typing
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError, did_you_mean


def read_toml(path: str | Path) -> dict[str, Any]:
    """The tables of a TOML file; every way it can fail is a ConfigError naming the file."""
    source = str(path)
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
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


# The help of every verb's recipe argument: a file, or a recipe shipped in the package (kiln.recipe_files).
RECIPE_HELP = "TOML recipe file, or the name of a packaged recipe (kiln recipes lists them)"


def parse_override(item: str) -> tuple[str, Any]:
    """``train.lr=3e-4`` -> ("train.lr", 3e-4); values parse as TOML, else as a bare string."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or "." not in key:
        raise ConfigError(key or show_key(item), "override must look like section.key=value", "<command line>")
    return key, parse_value(text)


def parse_value(text: str) -> Any:
    """A command-line value: TOML (``3e-4``, ``true``, ``[1, 2]``, ``"x"``), else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (ValueError, RecursionError):  # not TOML, over 4300 digits, or "[[[[..." nested too deeply
        return text  # unquoted strings such as model.preset=tiny


def finite_float(text: str) -> float:
    """argparse type of every float flag: a number, and finite (float() reads nan and inf), so that
    `--temperature nan` is one usage line naming the flag, as the recipe refuses train.lr=nan."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def set_dotted(tree: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(key, f"{part!r} is a value, not a table")
        tree = node
    tree[leaf] = value


def build(cls: type, table: dict[str, Any], section: str, base=None):
    # Fields only: class-level constants (ClassVar) are not configurable.
    all_hints = typing.get_type_hints(cls)
    hints = {f.name: all_hints[f.name] for f in dataclasses.fields(cls)}
    base = base if base is not None else cls()
    # A table that names a preset starts from it (e.g. [model] preset = "llama-8b"); the dataclass
    # says how, through a from_preset classmethod, so this module needs to know no component.
    preset_name = table.get("preset")
    from_preset = getattr(cls, "from_preset", None)
    if from_preset is not None and preset_name is not None:
        if not isinstance(preset_name, str):
            raise ConfigError(f"{section}.preset", f"expected a string, got {_kind(preset_name)} {_show(preset_name)}")
        if preset_name:
            try:
                base = from_preset(preset_name)
            except ConfigError as err:
                raise err.within(section) from None
    # A field may name values it refuses with its own message before the type check (e.g. a key that
    # changed type, whose old spelling deserves more than "expected a string").
    refusers = {f.name: f.metadata["refuse"] for f in dataclasses.fields(cls) if "refuse" in f.metadata}
    values = {}
    for key, value in table.items():
        if key not in hints:
            raise ConfigError(
                f"{section}.{show_key(key)}", f"unknown key{did_you_mean(key, hints)}; known: {', '.join(hints)}"
            )
        refused = refusers[key](value) if key in refusers else None
        if refused:
            raise ConfigError(f"{section}.{key}", refused)
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            # A nested table overrides the enclosing default's values (e.g. [dpo.train] keeps DPO's
            # fine-tuning defaults for every key it does not set), not the nested class's own.
            values[key] = build(hints[key], value, f"{section}.{key}", base=getattr(base, key))
        else:
            values[key] = _coerce(value, hints[key], f"{section}.{key}")
    return dataclasses.replace(base, **values)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            if option is type(None) and value is None:
                return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # X | None: X's own error, which names a nested table's full key
            return _coerce(value, options[0], key)
        errors = []
        for option in options:
            try:
                return _coerce(value, option, key)
            except ConfigError as err:
                errors.append(err.message)
        raise ConfigError(key, "; ".join(errors))
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a table, got {_kind(value)}")
        return build(hint, value, key)
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
        # TOML types 1e9 as a float; taking whole floats for integer keys would let a sweep's float
        # range pass its bounds check on an integer key, so they are refused, with the spelling to use.
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            raise ConfigError(key, f"expected an integer, got the number {_show(value)}; write it as {int(value)}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {_kind(value)} {_show(value)}")
        _check_int64(value, key)
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {_kind(value)} {_show(value)}")
        if isinstance(value, int):
            _check_int64(value, key)
        # TOML writes nan and inf; no config key means either, and every range check written as
        # `x <= 0` lets NaN through, so they stop here for every float field of every config.
        if not math.isfinite(value):
            raise ConfigError(key, f"must be a finite number, got {value}")
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


def show_key(name: str) -> str:
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
