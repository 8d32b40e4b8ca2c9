"""Errors shared by every memlm subpackage, and the one way a command reports them.

Every error memlm raises on purpose is a `MemlmError`: a bad config value
(`ConfigError`), a bad data record or shard, a bad checkpoint, eval task
file or export, a loss that stayed non-finite, a busy run folder, a peer
rank that did not meet this one at the end of a run. Each kind carries
its exit code (`exit_code`); docs/errors.md lists them. Every command's
`main` is wrapped in `entry_point`, so any of them ends the command with one
`error: ...` line on stderr and that code, whichever command it is:

    @entry_point
    def main(argv: list[str] | None = None) -> int:
        ...

`MEMLM_DEBUG=1` in the environment prints the traceback before the line.
Anything else (a bug) is left to Python: a traceback and exit 1.

`ConfigError` is raised for any invalid configuration value. It always names
the offending key, the value it had, and what would have been valid, so a
user can fix a sweep or launch command without reading the code.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

DEBUG_ENV = "MEMLM_DEBUG"  # "1": entry_point prints a MemlmError's traceback too

USAGE_EXIT = 2  # what was typed is wrong (as argparse exits on a bad option)
FAULT_EXIT = 1  # what memlm read or ran into is wrong: a file, a run, a peer


class MemlmError(Exception):
    """An error memlm raises on purpose: its message says what is wrong and what to do.

    exit_code: the command's exit status when it ends on this error.
    same_on_every_rank: every rank of a torchrun job raises it alike, so only
        rank 0 prints it; otherwise every rank that raises it prints it, named.
    """

    exit_code = FAULT_EXIT
    same_on_every_rank = True


class ConfigError(MemlmError, ValueError):
    """An invalid configuration value: `key=value`, and what is valid instead."""

    exit_code = USAGE_EXIT

    def __init__(self, key: str, value: Any, valid: str):
        self.key = key
        self.value = value
        self.valid = valid
        super().__init__(f"invalid config value {key}={value!r}: {valid}")


def launcher_rank() -> tuple[int, int]:
    """(rank, world size) as the launcher set them (torchrun: RANK, WORLD_SIZE); (0, 1) for one process.
    What a process is before and after its group; memlm.distributed.env's DistEnv takes them from here."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def error_line(err: MemlmError, rank: int, world_size: int) -> str | None:
    """The line a rank prints for `err`, or None when rank 0 speaks for it."""
    if world_size > 1 and not err.same_on_every_rank:
        return f"error: rank {rank}: {err}"
    if rank != 0:
        return None
    return f"error: {err}"


def report(err: MemlmError) -> int:
    """Print `err` as the one `error: ...` line (with its traceback under MEMLM_DEBUG=1); its exit code."""
    rank, world_size = launcher_rank()
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        traceback.print_exception(err, file=sys.stderr)
    line = error_line(err, rank, world_size)
    if line is not None:
        print(line, file=sys.stderr, flush=True)
    return err.exit_code


def entry_point(main: Callable[..., int]) -> Callable[..., int]:
    """A command's main(argv): a MemlmError it raises becomes `report(err)`'s line and exit code."""

    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except MemlmError as err:
            return report(err)

    return run


def check_number(key: str, value: float, zero: str = "") -> None:
    """An optimizer number must be finite and positive; `zero` (what 0 means)
    makes 0 valid too. A NaN or inf here would reach the weights at the first step."""
    if math.isfinite(value) and (value > 0 or (zero and value == 0)):
        return
    raise ConfigError(key, value, f"a finite number > 0{f' (or 0: {zero})' if zero else ''}")
