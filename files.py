"""Writing files safely: atomically, only where a command may write, with manifests of what it wrote.

    from memlm.files import atomic_write_bytes, atomic_write_json, atomic_write_text, atomic_output
    atomic_write_json(run_dir / "summary.json", summary, indent=2)
    with atomic_output(target, suffix=".so") as tmp:   # a tool writes the file itself
        subprocess.run([cc, ..., "-o", str(tmp)], check=True)
    with atomic_output_dir(out_dir) as tmp:            # a whole folder (an export)
        save_file(state, str(tmp / "model.safetensors"))

A reader sees the old file or the new one, never half of one. Every write
goes to a private temporary name in the same directory (so the
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

What a command may write over (every command that writes files or folders
checks its target with these before it writes anything; OutputError, one line,
exit 2: the path is the fix):

    check_output_path(out_dir, {checkpoint: "the checkpoint it exports"})  # not an input, no run folder
    check_output_file(out, "slot-usage file", is_usage_file)                 # replaces only its own kind
    manifest = folder_manifest(out_dir)                                      # {name: {"size", "crc32"}}
    foreign_files(out_dir, manifest), changed_files(out_dir, manifest)       # what it did not write

A memlm run folder (a dump_dir: `checkpoints/` or `run.lock` in it) is never
an output target, nor a folder holding one. A manifest lists the files a
command wrote with their size and crc32 (checkpoints keep one in meta.json,
exports in memlm_manifest.json): a file it does not list, or whose bytes
differ, is not the command's to replace or delete.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from memlm.errors import USAGE_EXIT, MemlmError

RUN_LOCK = "run.lock"  # dump_dir/run.lock (memlm.checkpoint.run_lock)
CHECKPOINTS = "checkpoints"  # dump_dir/checkpoints/ (memlm.checkpoint)


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


def follow_umask(path: str | os.PathLike) -> None:
    """Give a file the mode `open()` would have given it (0666 less the umask): for files a tool
    writes with a private mode (safetensors' save_file writes 0600), so a shared folder stays readable."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    try:  # Linux: read it without changing it
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ------------------------------------------------------------------ manifests
def crc32_file(path: Path) -> int:
    crc = 0
    with Path(path).open("rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def json_crc32(obj: Any) -> int:
    """crc32 of `obj` as canonical JSON (sorted keys, no spaces): a manifest's seal on itself."""
    return zlib.crc32(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def entry_fault(path: Path, entry: dict[str, int], with_checksum: bool = True) -> str | None:
    """What differs between the file at `path` and its manifest entry ({"size", "crc32"}), as the
    end of a sentence naming the file ("is missing", ...); None when it matches."""
    path = Path(path)
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != entry["size"]:
        return f"has {size} bytes, expected {entry['size']} (truncated?)"
    if with_checksum and "crc32" in entry and crc32_file(path) != entry["crc32"]:
        return "is corrupted (crc32 mismatch)"
    return None


def folder_files(folder: Path) -> list[str]:
    """Every file and link under `folder` (links not followed), as sorted relative POSIX paths."""
    folder = Path(folder)
    found = []
    for root, dirs, files in os.walk(folder):
        base = Path(root)
        links = [d for d in dirs if (base / d).is_symlink()]
        dirs[:] = [d for d in dirs if d not in links]
        found += [(base / name).relative_to(folder).as_posix() for name in [*files, *links]]
    return sorted(found)


def folder_manifest(folder: Path, exclude: Iterable[str] = ()) -> dict[str, dict[str, int]]:
    """{relative path: {"size", "crc32"}} of every file under `folder` but those in `exclude`."""
    folder, skip = Path(folder), set(exclude)
    return {name: {"size": (folder / name).stat().st_size, "crc32": crc32_file(folder / name)}
            for name in folder_files(folder) if name not in skip and (folder / name).is_file()}


def foreign_files(folder: Path, manifest: dict[str, Any], exclude: Iterable[str] = ()) -> list[str]:
    """Files under `folder` that its manifest does not list (nor `exclude`): not the writer's."""
    known = set(manifest) | set(exclude)
    return [name for name in folder_files(folder) if name not in known]


def changed_files(folder: Path, manifest: dict[str, dict[str, int]]) -> list[str]:
    """Files the manifest lists that are present with other bytes: changed since they were written."""
    return [name for name, entry in manifest.items()
            if (Path(folder) / name).is_file() and entry_fault(Path(folder) / name, entry) is not None]


def listing(names: list[str], limit: int = 5) -> str:
    """Up to `limit` names, then how many more: for a one-line message."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# ------------------------------------------------------------------ what a command may write over
class OutputError(MemlmError):
    """A command's output path is refused before anything is written: writing there would delete
    or replace what the command did not write (a user's file, a run, its own input)."""

    exit_code = USAGE_EXIT  # the path typed is the fix


def is_run_folder(path: Path) -> bool:
    """A memlm run folder (a dump_dir): a run has started there."""
    path = Path(path)
    return (path / CHECKPOINTS).is_dir() or (path / RUN_LOCK).is_file()


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def check_output_path(target: Path, inputs: dict[Path, str] | None = None) -> None:
    """`target`, where a command will write, is none of its `inputs` ({path: what it is}), holds
    none of them, lies inside no input folder, and is no memlm run folder nor holds one.
    OutputError naming the conflict otherwise."""
    target = Path(target)
    real = _real(target)
    for path, what in (inputs or {}).items():
        other = _real(path)
        if real == other:
            raise OutputError(f"{target} is {what} ({path}): choose another output path")
        if real in other.parents:
            raise OutputError(f"{target} holds {what} ({path}): choose an output path outside it")
        if other in real.parents and other.is_dir():
            raise OutputError(f"{target} lies inside {what} ({path}): choose an output path outside it")
    if real.is_dir():
        if is_run_folder(real):
            raise OutputError(f"{target} is a memlm run folder (it holds {CHECKPOINTS}/ or {RUN_LOCK}), "
                              "which no command writes over: choose another output path")
        runs = sorted(p.name for p in real.iterdir() if p.is_dir() and is_run_folder(p))
        if runs:
            raise OutputError(f"{target} holds memlm run folders ({listing(runs)}), which no command writes "
                              "over: choose another output path")


def check_output_file(target: Path, kind: str, is_own: Callable[[Path], bool], flag: str = "",
                      replace: bool = False) -> None:
    """An existing file at `target` is replaced only when it is a `kind` (`is_own(target)`: what this
    command writes) and, for a command with a flag for it (`flag`, e.g. "--overwrite"), `replace`
    is set. A folder is never a file target. OutputError naming the file otherwise."""
    target = Path(target)
    if target.is_dir():
        raise OutputError(f"{target} is a folder: name the {kind} to write")
    if not target.exists() and not target.is_symlink():
        return
    if not is_own(target):
        raise OutputError(f"{target} exists and is not a {kind}, so it is left alone: choose another path")
    if flag and not replace:
        raise OutputError(f"{target} exists (a {kind}): add {flag} to replace it, or choose another path")
