"""Atomic file writes: a reader sees the old file or the new one, never half of one.

    from memlm.files import atomic_write_bytes, atomic_write_json, atomic_write_text, atomic_output
    atomic_write_json(run_dir / "summary.json", summary, indent=2)
    with atomic_output(target, suffix=".so") as tmp:   # a tool writes the file itself
        subprocess.run([cc, ..., "-o", str(tmp)], check=True)

Every write goes to a private temporary name in the same directory (so the
rename never crosses file systems; the name holds the PID and a random part,
so processes that write the same file at once never share a temporary), is
flushed and fsync'ed, and then renamed over the target with `os.replace`
(atomic on POSIX). With `durable=True` (default) the directory is fsync'ed
too, so the rename itself survives a power loss: checkpoints, manifests and
shards rely on that order. If anything fails the temporary is removed and
the target is untouched.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


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
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
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
