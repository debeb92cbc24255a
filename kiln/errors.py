"""Errors that Kiln shows to users as one line naming what is wrong and where."""

import difflib


class ConfigError(ValueError):
    """A recipe or override value is unknown, of the wrong type, or impossible.

    Components raise it with the field name relative to their own section
    (``ConfigError("n_heads", "must divide dim")``); the recipe loader prefixes the
    section and the recipe file so the message names the full dotted key.
    """

    def __init__(self, key: str, message: str, source: str | None = None):
        self.key = key
        self.message = message
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{key}: {message}")

    def __reduce__(self):
        # Raised in a worker process and re-raised in the parent: rebuild from the parts.
        return (ConfigError, (self.key, self.message, self.source))

    def within(self, section: str, source: str | None = None) -> "ConfigError":
        key = f"{section}.{self.key}" if section else self.key
        return ConfigError(key, self.message, source or self.source)


class DataError(ValueError):
    """Input data is malformed; the message names the file (and line where known)."""


class TrainingDiverged(RuntimeError):
    """The guard fired more than `train.guard.max_events` times: the run is not recovering."""


def did_you_mean(word: str, known) -> str:
    """'; did you mean "x"?' for the closest of `known` to a misspelt `word`, or "" when none is close:
    appended to an unknown-name error, so a typo is answered with its fix."""
    close = difflib.get_close_matches(str(word), [str(k) for k in known], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
