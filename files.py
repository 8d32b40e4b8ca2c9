"""Atomic file writes: a reader sees the old file or the new one, never half of one.

    from memlm.files import atomic_write_bytes, atomic_write_json, atomic_write_text, atomic_output
    atomic_write_json(run_dir / "summary.json", summary, indent=2)
    with atomic_output(target, suffix=".so") as tmp:   # a tool writes the file itself
        subprocess.run([cc, ..., "-o", str(tmp)], check=True)
    with atomic_output_dir(out_dir) as tmp:            # a whole folder (an export)
        save_file(state, str(tmp / "model.safetensors"))

Every write goes to a private temporary name in the same directory (so the
rename never crosses file systems; the name holds the PID and a random part,
so processes that write the same file at once never share a temporary), is
flushed and fsync'ed, and then renamed over the target with `os.replace`
(atomic on POSIX). With `durable=True` (default) the directory is fsync'ed
too, so the rename itself survives a power loss: checkpoints, manifests and
shards rely on that order. If anything fails the temporary is removed and
the target is untouched.

A folder is written the same way: into a new folder beside it
(`.<name>.new<pid>.<random>`), every file fsync'ed, then swapped in with two
renames (the old folder moved aside to `.<name>.old<pid>.<random>`, the new
one renamed in) and only then the old one removed. A process killed while
writing leaves the old folder whole; between the two renames (a moment) the
folder is missing and the old one is beside it. What a killed process left
beside the folder is removed by the next write of the same folder.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some file systems do not open directories; the rename still happened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_output(path: str | os.PathLike, suffix: str = "", durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block ends without an
    error, the file written there replaces `path`. `suffix` ends the temporary
    name (tools such as numpy.save or a compiler add or expect one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{secrets.token_hex(4)}{suffix}")
    try:
        yield tmp
        if durable:
            _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, durable: bool = True) -> None:
    with atomic_output(path, durable=durable) as tmp:
        with open(tmp, "xb") as fh:
            fh.write(data)


def atomic_write_text(path: str | os.PathLike, text: str, durable: bool = True, encoding: str = "utf-8") -> None:
    atomic_write_bytes(path, text.encode(encoding), durable=durable)


def atomic_write_json(path: str | os.PathLike, obj: Any, durable: bool = True, **dumps_kwargs: Any) -> None:
    """`json.dumps(obj, **dumps_kwargs)` plus a final newline when indented."""
    text = json.dumps(obj, **dumps_kwargs)
    atomic_write_text(path, text + ("\n" if dumps_kwargs.get("indent") is not None else ""), durable=durable)


@contextmanager
def atomic_output_dir(path: str | os.PathLike, durable: bool = True) -> Iterator[Path]:
    """Yield a new, empty folder beside `path`; when the block ends without an
    error, it replaces `path` (a folder or a file, if one is there). On an
    error the new folder is removed and `path` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(path)
    tmp = _sibling(path, "new")
    tmp.mkdir()
    try:
        yield tmp
        if durable:
            for file in tmp.rglob("*"):
                if file.is_file():
                    _fsync_file(file)
            _fsync_dir(tmp)
    except BaseException:
        _remove(tmp)
        raise
    old = None
    if path.exists() or path.is_symlink():
        old = _sibling(path, "old")
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        if old is not None:
            os.rename(old, path)
        _remove(tmp)
        raise
    if durable:
        _fsync_dir(path.parent)
    if old is not None:
        _remove(old)


def _sibling(path: Path, kind: str) -> Path:
    return path.with_name(f".{path.name}.{kind}{os.getpid()}.{secrets.token_hex(4)}")


def _remove_leftovers(path: Path) -> None:
    """Remove what a killed atomic_output_dir of `path` left beside it: names
    of its pattern whose process is gone (a live writer's folder is kept)."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(?:new|old)(\d+)\.[0-9a-f]{{8}}")
    for entry in path.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match and not _alive(int(match.group(1))):
            _remove(entry)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine (this one included)."""
    try:
        os.kill(pid, 0)  # signal 0: only asks
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
