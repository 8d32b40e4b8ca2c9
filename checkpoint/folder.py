"""The on-disk rules of `dump_dir/checkpoints/`: names, integrity, `latest`, recovery, lineage.

    meta = verify(path)                       # CheckpointError naming the bad file
    path = latest_checkpoint(root)            # what a reader (export, evals) should load
    recover(root); abandon_later(root, step)  # the writer, under the run lock

Names: `step_XXXXXXXX` is a published checkpoint; `.tmp_step_X` a save in
progress; `.old_step_X` the previous copy of a step being saved again (it
exists only between two renames); `abandoned_<UTC time>/` holds checkpoints
with later steps than the one a run restarted from (a rollback or a fresh
start): they belong to a history the run left, so they are never resumed,
pruned or pointed at. `latest` names the newest published checkpoint.

Integrity: meta.json holds a manifest (every other file's size and crc32)
and `meta_crc32`, a crc32 of meta.json's own content, so an edited or
damaged meta.json fails like a damaged shard; its `step` must also match the
folder's name. Checkpoints written before `meta_crc32` existed are checked
for structure and step only.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from memlm.errors import MemlmError
from memlm.files import atomic_write_text, crc32_file, json_crc32

PREFIX = "step_"
TMP = ".tmp_"
OLD = ".old_"
ABANDONED = "abandoned_"
META = "meta.json"
LATEST = "latest"
DIGEST_KEY = "meta_crc32"
# What every meta.json holds, with its JSON type (the trainer adds more).
META_TYPES = {"step": int, "world_size": int, "tokens": int, "scheduler": dict, "param_groups": list,
              "config": str, "manifest": dict}


class CheckpointError(MemlmError, RuntimeError):
    """A checkpoint folder that is missing, half-written, damaged or refused (its message names the file)."""


def missing_checkpoint(path: Path | str) -> CheckpointError:
    """The one error of every command for a model path that does not exist (exit code 1, as any file
    the user hands in that is missing)."""
    return CheckpointError(f"no checkpoint at {path}: the directory does not exist")


def step_of(name: str) -> int | None:
    """The step of a checkpoint folder name (`step_N`, `.tmp_step_N`, `.old_step_N`), else None."""
    for prefix in (TMP, OLD):
        name = name.removeprefix(prefix)
    digits = name[len(PREFIX):]
    return int(digits) if name.startswith(PREFIX) and digits.isdigit() else None


def checkpoint_dirs(root: Path) -> list[Path]:
    """Every published-name folder (`step_N`, complete or not), newest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and step_of(p.name) is not None]
    return sorted(found, key=lambda p: step_of(p.name), reverse=True)


def misnamed_dirs(root: Path) -> list[Path]:
    """`step_*` folders whose name carries no step number (never loaded)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and step_of(p.name) is None)


def complete_checkpoints(root: Path) -> list[Path]:
    """Folders that look complete (meta.json present), newest step first."""
    return [p for p in checkpoint_dirs(root) if (p / META).is_file()]


# ------------------------------------------------------------------ integrity (crc32_file: memlm.files)
def manifest(directory: Path, with_checksum: bool, rank: int = 0, world: int = 1) -> dict[str, dict[str, int]]:
    """Size (and crc32) of the files of `directory` (not meta.json). With
    rank/world: only this rank's share (`share`), so the ranks of a job hash a
    checkpoint in parallel, each about 1/world of its bytes; the shares are disjoint."""
    files = share(sorted(p for p in directory.iterdir() if p.is_file() and p.name != META), rank, world)
    return {p.name: {"size": p.stat().st_size, **({"crc32": crc32_file(p)} if with_checksum else {})} for p in files}


def share(files: list[Path], rank: int, world: int) -> list[Path]:
    """This rank's part of `files`: largest first to the least loaded rank (ties:
    lowest rank), from sizes every rank reads alike, so every rank computes the
    same split without talking. DCP writes one data file per rank of about equal
    size: each rank gets about 1/world of the bytes."""
    if world == 1:
        return files
    loads = [0] * world
    mine = []
    for path in sorted(files, key=lambda p: (-p.stat().st_size, p.name)):
        owner = min(range(world), key=lambda r: (loads[r], r))
        loads[owner] += path.stat().st_size
        if owner == rank:
            mine.append(path)
    return sorted(mine)


def _digest(meta: dict[str, Any]) -> int:
    return json_crc32({k: v for k, v in meta.items() if k != DIGEST_KEY})


def seal_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """meta with its own crc32 added (what a save writes as meta.json)."""
    return {**meta, DIGEST_KEY: _digest(meta)}


def read_meta(directory: Path) -> dict[str, Any]:
    """meta.json of a checkpoint folder, checked for structure, its own crc32
    and its step; CheckpointError naming the file otherwise."""
    directory = Path(directory)
    path = directory / META
    if not directory.is_dir():
        raise missing_checkpoint(directory)
    if not path.is_file():
        raise CheckpointError(f"{directory} is not a complete checkpoint: {path} is missing")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is unreadable: {err}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is malformed: a JSON object was expected, found a {type(meta).__name__}")
    for key, kind in META_TYPES.items():
        if key not in meta:
            raise CheckpointError(f"{path} is malformed: key {key!r} is missing")
        if not isinstance(meta[key], kind) or isinstance(meta[key], bool):
            raise CheckpointError(f"{path} is malformed: {key}={str(meta[key])[:60]!r} is not a JSON {kind.__name__}")
    for name, entry in meta["manifest"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int):
            raise CheckpointError(f"{path} is malformed: manifest entry {name!r} is {str(entry)[:60]!r}, "
                                  "expected {\"size\": bytes, \"crc32\": int}")
    if DIGEST_KEY in meta and meta[DIGEST_KEY] != _digest(meta):
        raise CheckpointError(f"{path} is corrupted or was edited: its {DIGEST_KEY} does not match its content")
    named = step_of(directory.name)
    if named is not None and named != meta["step"]:
        raise CheckpointError(f"{path} says step {meta['step']} but its folder is {directory.name} (step {named})")
    return meta


def verify(directory: Path, with_checksum: bool = True, rank: int = 0, world: int = 1,
           meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """Check a checkpoint against its manifest; return its meta. Raises
    CheckpointError naming the first missing, truncated or corrupted file.
    With rank/world: only this rank's share of the files is read (sizes are
    checked for all: they cost no read); the caller agrees on the outcome.
    `meta`: the folder's meta.json as read_meta returned it, when the caller read it already."""
    directory = Path(directory)
    meta = read_meta(directory) if meta is None else meta
    present = [directory / n for n in meta["manifest"] if (directory / n).is_file()]
    hashed = {p.name for p in share(present, rank, world)}
    for name, expected in meta["manifest"].items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        if path.stat().st_size != expected["size"]:
            raise CheckpointError(f"checkpoint file {path} has {path.stat().st_size} bytes, "
                                  f"expected {expected['size']} (truncated?)")
        if with_checksum and "crc32" in expected and name in hashed and crc32_file(path) != expected["crc32"]:
            raise CheckpointError(f"checkpoint file {path} is corrupted (crc32 mismatch)")
    return meta


# ------------------------------------------------------------------ latest
def write_latest(root: Path, name: str) -> None:
    atomic_write_text(root / LATEST, name + "\n")


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint a reader should load: the one `latest` names; if a kill
    left it between the two renames of a re-save, its `.old_` or complete
    `.tmp_` copy (same step); if `latest` is missing or dangling, the newest
    complete checkpoint. None when there is none."""
    path = root / LATEST
    try:
        name = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        name = None if not path.exists() else "<unreadable>"
    if name is not None and step_of(name) is not None and name.startswith(PREFIX):
        for candidate in (root / name, root / f"{OLD}{name}", root / f"{TMP}{name}"):
            if (candidate / META).is_file():
                return candidate
    found = complete_checkpoints(root)
    if name is not None:  # a `latest` that names no complete checkpoint: said, not silently passed over
        instead = f"reading the newest complete checkpoint, {found[0].name}" if found else "and there is none"
        print(f"[checkpoint] warning: {path} names no complete checkpoint ({name[:60]!r}), {instead}",
              file=sys.stderr, flush=True)
    return found[0] if found else None


def repair_latest(root: Path) -> str | None:
    """Point `latest` at an existing complete checkpoint (or remove it when
    there is none); returns the name it holds."""
    current = latest_checkpoint(root)
    if current is None or not current.name.startswith(PREFIX):
        found = complete_checkpoints(root)
        current = found[0] if found else None
    if current is None:
        (root / LATEST).unlink(missing_ok=True)
        return None
    try:
        unchanged = (root / LATEST).read_text().strip() == current.name
    except OSError:
        unchanged = False
    if not unchanged:
        write_latest(root, current.name)
    return current.name


# ------------------------------------------------------------------ writer side (rank 0, run lock held)
def recover(root: Path, with_checksum: bool = True) -> list[str]:
    """Finish or undo a publish that a kill interrupted, remove what
    interrupted saves left, and repair `latest`. Returns what was done."""
    if not root.is_dir():
        return []
    done = []
    for old in sorted(root.glob(f"{OLD}{PREFIX}*")):
        name = old.name[len(OLD):]
        final, tmp = root / name, root / f"{TMP}{name}"
        if (final / META).is_file():
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed {old.name} (left by a re-save of {name} that completed)")
            continue
        try:
            verify(tmp, with_checksum)
            source = tmp
        except CheckpointError:
            source = old
        if final.exists():
            shutil.rmtree(final)
        os.replace(source, final)
        shutil.rmtree(old, ignore_errors=True)
        done.append(f"restored {name} from {source.name} (a re-save was interrupted between its renames)")
    for stale in sorted(root.glob(f"{TMP}*")):
        shutil.rmtree(stale, ignore_errors=True)
        done.append(f"removed {stale.name} (an interrupted save)")
    repair_latest(root)
    return done


def abandon_later(root: Path, step: int) -> tuple[Path | None, list[str]]:
    """Move every checkpoint folder with a step later than `step` into
    `abandoned_<UTC time>/`: a run that restarts at `step` never resumes,
    prunes or points `latest` at them. Returns (that folder, the names moved)."""
    later = [p for p in checkpoint_dirs(root) if step_of(p.name) > step]
    if not later:
        return None, []
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    dest, n = root / f"{ABANDONED}{stamp}", 1
    while dest.exists():
        n += 1
        dest = root / f"{ABANDONED}{stamp}_{n}"
    dest.mkdir()
    for path in later:
        os.replace(path, dest / path.name)
    repair_latest(root)
    return dest, [p.name for p in sorted(later)]
