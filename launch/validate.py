"""Checks every launcher runs before it starts a process or writes a file.

A launch fails here, with a message naming the bad value and what is valid,
instead of minutes later inside a rank (or hours later in a Slurm queue).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from memlm.errors import USAGE_EXIT, ConfigError, MemlmError

if TYPE_CHECKING:
    from memlm.config.run import Config


class LaunchError(MemlmError, ValueError):
    """A bad launcher option or environment (not a config value): says what to do instead."""

    exit_code = USAGE_EXIT


def check_positive(flag: str, value: int) -> None:
    if value < 1:
        raise LaunchError(f"{flag} {value}: must be an integer >= 1")


def split_sweeps(overrides: Sequence[str]) -> list[str]:
    """The overrides that are sweeps (a,b / range() / glob()); parsing with
    Hydra's own grammar, so a malformed override fails here with Hydra's message."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as err:
        raise ConfigError("overrides", list(overrides), f"valid Hydra override syntax; Hydra said: {err}") from None
    return [o.input_line or "" for o in parsed if o.is_sweep_override()]


def compose_for_launch(overrides: Sequence[str], world_size: int, world_desc: str) -> Config:
    """Compose and validate `overrides` for a job of `world_size` ranks.

    world_desc says where the world size comes from (e.g. "--nproc 3"), so the
    divisibility error names both the config value and the launcher option.
    """
    from memlm.config.run import compose

    sweeps = split_sweeps(overrides)
    if sweeps:
        raise ConfigError(
            "overrides", sweeps,
            "single values; a sweep (a,b / range() / glob()) needs `python -m memlm.launch sweep`",
        )
    cfg = compose(list(overrides))  # unknown keys and bad values raise ConfigError here
    mp = cfg.parallel.memory_parallel
    if mp != "auto" and world_size % mp:  # auto divides any world size
        valid = ", ".join(str(mp * k) for k in range(1, 5))
        raise ConfigError(
            "parallel.memory_parallel", mp,
            f"a divisor of the world size, but {world_desc} gives {world_size} rank(s); "
            f"use a world size that is a multiple of {mp} ({valid}, ...) or a parallel.memory_parallel "
            f"that divides {world_size}",
        )
    return cfg


def has_key(overrides: Sequence[str], key: str) -> bool:
    """Whether an override sets `key` (with or without +/++ prefixes)."""
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)
