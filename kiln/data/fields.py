"""Which fields of a JSON or Parquet record make a document: text, id, source and meta.

Public datasets name their fields differently (RefinedWeb keeps the text in `content`, The Pile
keeps its subset name in `meta.pile_set_name`), so every input may say where each part of the
document `{"id", "text", "source", "meta"}` comes from. A key is a field name or a dotted path into
nested objects (`meta.pile_set_name`); a record holding that exact flat name wins over the path.

`meta_keys` left unset keeps the reader's original rule: the record's own `meta` object plus every
other top-level field. Set, it lists exactly what goes to `meta`, each under its last path
component (`meta.pile_set_name` -> `meta["pile_set_name"]`); a listed key a record lacks is left
out of that record's meta.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from kiln.errors import ConfigError

# Column names as the datasets' own cards list them (Hugging Face dataset_info features):
# tiiuae/falcon-refinedweb, EleutherAI's Pile JSONL, allenai/c4, HuggingFaceFW/fineweb.
PRESETS: dict[str, dict] = {
    "refinedweb": {"text_key": "content", "meta_keys": ["url", "timestamp", "dump", "segment"]},
    "pile": {"text_key": "text", "meta_keys": ["meta.pile_set_name"]},
    "c4": {"text_key": "text", "meta_keys": ["url", "timestamp"]},
    "fineweb": {
        "text_key": "text",
        "id_key": "id",
        "meta_keys": ["url", "dump", "date", "file_path", "language", "language_score", "token_count"],
    },
}

_MISSING = object()


@dataclass
class FieldMap:
    """Where a record's document fields are (module docstring); `preset` starts from a known layout."""

    preset: str = ""
    text_key: str = "text"
    id_key: str = "id"
    source_key: str = "source"
    meta_keys: list[str] | None = None  # None: `meta` plus every other top-level field

    @classmethod
    def from_preset(cls, name: str) -> "FieldMap":
        if name not in PRESETS:
            raise ConfigError("preset", f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
        return cls(preset=name, **PRESETS[name])

    def validate(self) -> None:
        if self.preset and self.preset not in PRESETS:
            raise ConfigError("preset", f"unknown preset {self.preset!r}; known: {', '.join(PRESETS)}")
        for name in ("text_key", "id_key", "source_key"):
            _check_path(getattr(self, name), name)
        seen: dict[str, str] = {}
        for i, key in enumerate(self.meta_keys or []):
            _check_path(key, f"meta_keys[{i}]")
            short = key.rsplit(".", 1)[-1]
            if short in seen:
                raise ConfigError(
                    f"meta_keys[{i}]", f"{key!r} and {seen[short]!r} would both be stored as meta key {short!r}"
                )
            seen[short] = key

    def suggestion(self, fields: list[str]) -> str:
        """What to set when a file's records lack `text_key`, from the fields they do have."""
        fitting = [n for n, p in PRESETS.items() if p["text_key"] in fields and p["text_key"] != self.text_key]
        if fitting:
            key = PRESETS[fitting[0]]["text_key"]
            return f'set text_key = "{key}" or preset = "{fitting[0]}"'
        return "set text_key to the field holding the text"


def _check_path(key: str, name: str) -> None:
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(name, f"must be a field name or a dotted path like 'meta.pile_set_name', got {key!r}")


def lookup(record: dict, key: str):
    """The value at `key` (a flat name first, then a dotted path), or the _MISSING sentinel."""
    if key in record:
        return record[key]
    node = record
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def has_field(record: dict, key: str) -> bool:
    return lookup(record, key) is not _MISSING


def jsonable(value):
    """Parquet timestamps and dates become ISO strings, so the documents can be written as JSON."""
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    return value


DEFAULT_FIELDS = FieldMap()


def map_record(
    record: dict, default_id: str, default_source: str, fields: FieldMap = DEFAULT_FIELDS
) -> tuple[dict | None, str | None]:
    """A document from a parsed record, or (None, reason) when a field is unusable.

    Reasons: missing_text, text_not_string, empty_text, bad_id, bad_source, bad_meta.
    """
    text = lookup(record, fields.text_key)
    if text is _MISSING or text is None:
        return None, "missing_text"
    if not isinstance(text, str):
        return None, "text_not_string"
    if not text.strip():
        return None, "empty_text"
    doc_id = lookup(record, fields.id_key)
    if doc_id is _MISSING or doc_id is None:
        doc_id = default_id
    elif isinstance(doc_id, int) and not isinstance(doc_id, bool):
        doc_id = str(doc_id)
    elif not isinstance(doc_id, str) or not doc_id:
        return None, "bad_id"
    source = lookup(record, fields.source_key)
    if source is _MISSING or source is None:
        source = default_source
    elif not isinstance(source, str) or not source:
        return None, "bad_source"
    if fields.meta_keys is None:
        meta = record.get("meta")
        if meta is None:
            meta = {}
        elif not isinstance(meta, dict):
            return None, "bad_meta"
        used = {fields.text_key, fields.id_key, fields.source_key, "meta"}
        extra = {k: v for k, v in record.items() if k not in used and k not in meta}
        if extra:
            meta = {**meta, **extra}
    else:
        meta = {}
        for key in fields.meta_keys:
            value = lookup(record, key)
            if value is not _MISSING:
                meta[key.rsplit(".", 1)[-1]] = value
    return {"id": doc_id, "text": text, "source": source, "meta": jsonable(meta)}, None
