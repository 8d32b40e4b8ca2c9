"""Errors shared by every memlm subpackage.

`ConfigError` is raised for any invalid configuration value. It always names
the offending key, the value it had, and what would have been valid, so a
user can fix a sweep or launch command without reading the code.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """An invalid configuration value: `key=value`, and what is valid instead."""

    def __init__(self, key: str, value: Any, valid: str):
        self.key = key
        self.value = value
        self.valid = valid
        super().__init__(f"invalid config value {key}={value!r}: {valid}")
