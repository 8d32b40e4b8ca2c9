"""Name a mistyped config key, with the key that was probably meant.

    err = unknown_key_error(["memory.n_kyes=64"], Config)
    str(err)  # "unknown key memory.n_kyes; did you mean memory.n_keys?"

Hydra answers an override of a key the config does not have with advice to
add it (`+memory.n_kyes=64`), which would only move the failure to the typed
config. `compose` asks this module first: it walks the dataclasses of the
run config along each override's dotted key and, at the first name the
schema lacks, suggests the closest names that level has (difflib).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Sequence

from memlm.errors import ConfigError


class UnknownKeyError(ConfigError):
    """An override names a key the run config does not have."""

    def __init__(self, key: str, value: str, suggestions: list[str], known: list[str]):
        hint = (f"did you mean {' or '.join(suggestions)}?" if suggestions
                else f"keys at this level: {', '.join(known)}")
        super().__init__(key, value, hint)
        ValueError.__init__(self, f"unknown key {key}; {hint}")


def _lookup(schema: type, parts: list[str]) -> tuple[int, list[str]] | None:
    """(index of the first unknown part, the names valid there), or None when the
    path is known or leaves the dataclasses (a dict or list field: not checked)."""
    current: typing.Any = schema
    for i, part in enumerate(parts):
        if not (isinstance(current, type) and dataclasses.is_dataclass(current)):
            return None
        hints = typing.get_type_hints(current)
        names = [f.name for f in dataclasses.fields(current)]
        if part not in names:
            return i, names
        current = hints[part]
    return None


def unknown_key_error(overrides: Sequence[str], schema: type, groups: Sequence[str] = ()) -> UnknownKeyError | None:
    """The error for the first override whose key `schema` lacks (config groups
    and Hydra's own keys are not schema keys), or None."""
    for override in overrides:
        key, sep, value = override.lstrip("+~").partition("=")
        if not sep or key in groups or key.startswith("hydra."):
            continue
        parts = key.split(".")
        found = _lookup(schema, parts)
        if found is None:
            continue
        i, names = found
        prefix = ".".join(parts[:i])
        close = difflib.get_close_matches(parts[i], names, n=2, cutoff=0.6)
        full = [f"{prefix}.{name}" if prefix else name for name in close]
        return UnknownKeyError(key, value, full, names)
    return None
