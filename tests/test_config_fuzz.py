"""Property tests of the recipe loader: any TOML text (valid or not, with real and made-up
sections, keys and values of any type) and any override string give a Recipe or a ConfigError
naming a key, never another exception and never a hang."""

import dataclasses
import json
import math
import typing

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kiln_testing.fuzz import fuzz_examples, fuzz_settings, no_hang  # noqa: E402

from kiln.config import parse_override  # noqa: E402
from kiln.errors import ConfigError  # noqa: E402
from kiln.recipe import Recipe, load_recipe, recipe_from_dict  # noqa: E402

# Modest by default so the suite stays fast; KILN_FUZZ_EXAMPLES raises it, and the `slow` tests
# below run ten times as many.
EXAMPLES = fuzz_examples(150)
FUZZ = fuzz_settings(EXAMPLES, [HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
HEAVY = settings(FUZZ, max_examples=EXAMPLES * 10)


# ---- what a recipe can hold ------------------------------------------------------------------------


def _fields(cls) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


SECTIONS = _fields(Recipe)
KEYS = {name: sorted(_fields(cls)) for name, cls in SECTIONS.items()}
NESTED = {
    (name, key): sorted(_fields(hint))
    for name, cls in SECTIONS.items()
    for key, hint in _fields(cls).items()
    if dataclasses.is_dataclass(hint)
}

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
# The 64-bit limit and float's; integers over 4300 digits (which Hypothesis cannot print) are
# covered by the regression tests below.
huge = st.sampled_from([2**63 - 1, -(2**63), 2**62, 2**63, -(2**63) - 1, 10**400])
scalars = (
    st.integers()
    | st.integers(-(2**70), 2**70)
    | huge
    | st.floats()
    | st.booleans()
    | st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20)
    | st.sampled_from(["tiny", "125m", "cpu", "auto", "", "..", "/", "adamw", "cosine", "train", "bf16"])
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(names, inner, max_size=3), max_leaves=8
)


def toml_key(key: str) -> str:
    return json.dumps(key)  # a basic string is a valid TOML key, whatever it holds


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        try:
            return str(value)
        except ValueError:  # over Python's 4300-digit limit; TOML's hex form has no sign, so value > 0
            return hex(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


@st.composite
def tables(draw):
    """A recipe as a dict: mostly real sections and keys (so the loader gets past the name checks
    and into type coercion and validation), sometimes made-up ones."""
    raw = {}
    for _ in range(draw(st.integers(0, 4))):
        section = draw(st.sampled_from(sorted(SECTIONS)) | names)
        table = raw.setdefault(section, {})
        if not isinstance(table, dict):
            continue
        for _ in range(draw(st.integers(0, 4))):
            key = draw(st.sampled_from(KEYS.get(section) or ["x"]) | names)
            if (section, key) in NESTED and draw(st.booleans()):
                sub = NESTED[section, key]
                table[key] = draw(st.dictionaries(st.sampled_from(sub) | names, values, max_size=3))
            else:
                table[key] = draw(values)
        if draw(st.integers(0, 9)) == 0:
            raw[section] = draw(scalars)  # a section that is a value, not a table
    return raw


def to_toml(raw: dict) -> str:
    lines = []
    for section, table in raw.items():
        if isinstance(table, dict):
            lines.append(f"[{toml_key(section)}]")
            lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items()]
        else:
            lines.insert(0, f"{toml_key(section)} = {toml_value(table)}")
    return "\n".join(lines) + "\n"


def check_loads(path=None, overrides=()) -> Recipe | ConfigError:
    with no_hang():
        try:
            recipe = load_recipe(path, list(overrides))
        except ConfigError as err:
            assert err.key and err.message, err  # the error names what is wrong and where
            return err
    assert isinstance(recipe, Recipe)
    recipe.validate()  # what load_recipe returns is a valid recipe
    return recipe


# ---- properties ------------------------------------------------------------------------------------


@FUZZ
@given(raw=tables())
def test_any_recipe_table_loads_or_names_the_key(tmp_path, raw):
    path = tmp_path / "r.toml"
    path.write_text(to_toml(raw), encoding="utf-8")
    check_loads(path)


@FUZZ
@given(text=st.text(max_size=300))
@example(text="[train]\nlr = " + "[" * 5000)
@example(text="x = " + "{a = " * 3000)
def test_any_text_loads_or_names_the_key(tmp_path, text):
    path = tmp_path / "r.toml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    check_loads(path)


@FUZZ
@given(data=st.binary(max_size=200))
@example(data=b"[train]\nlr = 1e-3\n# \xff\xfe")
@example(data=b"\xef\xbb\xbf[train]\n")
def test_any_bytes_load_or_name_the_key(tmp_path, data):
    path = tmp_path / "r.toml"
    path.write_bytes(data)
    check_loads(path)


@st.composite
def overrides(draw):
    section = draw(st.sampled_from(sorted(SECTIONS)) | names)
    key = draw(st.sampled_from(KEYS.get(section) or ["x"]) | names)
    if (section, key) in NESTED and draw(st.booleans()):
        key = f"{key}.{draw(st.sampled_from(NESTED[section, key]) | names)}"
    value = draw(values.map(toml_value) | st.text(max_size=30))
    return f"{section}.{key}={value}"


@FUZZ
@given(items=st.lists(overrides() | st.text(max_size=40), max_size=4))
@example(items=["model.preset=[1]"])
@example(items=["model.preset={a = 1}"])
@example(items=["train.lr=" + "1" * 400])
@example(items=["train.lr=" + "[" * 5000])
def test_any_overrides_load_or_name_the_key(items):
    check_loads(None, items)


@FUZZ
@given(item=st.text(max_size=60))
def test_parse_override_gives_a_pair_or_config_error(item):
    with no_hang():
        try:
            key, _ = parse_override(item)
        except ConfigError as err:
            assert err.source == "<command line>"
            return
    assert "." in key and key == key.strip()


@FUZZ
@given(raw=st.dictionaries(names | st.sampled_from(sorted(SECTIONS)), values, max_size=4))
def test_recipe_from_any_dict(raw):
    """recipe_from_dict also takes dicts that did not come from TOML (sweeps build them)."""
    with no_hang():
        try:
            recipe_from_dict(raw).validate()
        except ConfigError as err:
            assert err.key and err.message


@pytest.mark.slow
@HEAVY
@given(raw=tables(), items=st.lists(overrides(), max_size=3))
def test_heavy_recipe_and_overrides(tmp_path, raw, items):
    path = tmp_path / "r.toml"
    path.write_text(to_toml(raw), encoding="utf-8")
    check_loads(path, items)


# ---- regressions the fuzzer found ------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, message",
    [
        (b"[train]\nlr = 1e-3\n\xff", "not UTF-8"),
        ("[train]\nlr = " + "[" * 5000, "nested too deeply"),
    ],
)
def test_unreadable_recipe_files_are_config_errors(tmp_path, data, message):
    path = tmp_path / "r.toml"
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    with pytest.raises(ConfigError, match=message) as info:
        load_recipe(path)
    assert info.value.key == "recipe" and info.value.source == str(path)


def test_recipe_path_that_is_a_folder(tmp_path):
    with pytest.raises(ConfigError, match="recipe: cannot read"):
        load_recipe(tmp_path)


@pytest.mark.parametrize("value", ["[1]", "{a = 1}", "1", "true"])
def test_preset_of_the_wrong_type(value):
    with pytest.raises(ConfigError, match=r"model.preset: expected a string"):
        load_recipe(None, [f"model.preset={value}"])


@pytest.mark.parametrize("key", ["train.lr", "train.max_steps"])
@pytest.mark.parametrize("value", ["1" * 400, "-" + "9" * 320, "0x" + "f" * 5000, str(2**63), str(-(2**63) - 1)])
def test_integer_outside_64_bits(key, value):
    # 400 digits overflowed float(); 0xfff... made an integer too long for str() in the message.
    with pytest.raises(ConfigError, match=rf"{key}: .*outside the 64-bit integer range") as info:
        load_recipe(None, [f"{key}={value}"])
    assert len(str(info.value)) < 300


def test_integers_at_the_64_bit_limits_load():
    assert load_recipe(None, [f"train.lr={2**63 - 1}"]).train.lr == float(2**63 - 1)
    assert load_recipe(None, [f"train.max_steps={2**63 - 1}"]).train.max_steps == 2**63 - 1


@pytest.mark.parametrize("text", ["1" * 5000, "[" + "1" * 5000 + "]"])
def test_integer_over_python_digit_limit(tmp_path, text):
    """tomllib raises a plain ValueError (not TOMLDecodeError) for a decimal over 4300 digits."""
    path = tmp_path / "r.toml"
    path.write_text(f"[train]\nlr = {text}\n")
    with pytest.raises(ConfigError, match=r"recipe: invalid TOML: Exceeds the limit"):
        load_recipe(path)
    with pytest.raises(ConfigError, match=r"train.lr: expected a number, got a string '1111.*\.\.\.") as info:
        load_recipe(None, [f"train.lr={text}"] if text[0] != "[" else [f"train.lr={text[1:-1]}"])
    assert len(str(info.value)) < 300


def test_deeply_nested_override_value_is_a_string():
    # Like any value that is not TOML, it stays the text it was, and the type check refuses it.
    assert parse_override("train.lr=" + "[" * 5000) == ("train.lr", "[" * 5000)
    with pytest.raises(ConfigError, match=r"train.lr: expected a number"):
        load_recipe(None, ["train.lr=" + "[" * 5000])
