"""Document sources: JSONL, Parquet and plain text files, optionally .gz / .zst compressed.

A source is a glob (or comma-separated globs) of files in one format. Files are
split into `WorkUnit`s, the pieces that preparation hands to worker processes:
uncompressed JSONL/text files larger than `chunk_bytes` are split into byte
ranges (a line belongs to the range holding its first byte), Parquet files into
row-group ranges, and compressed files are read whole (they cannot be seeked).
Everything is streamed: a unit never holds more than one batch of records.

Bad records raise `DataError` naming file and line, or are counted in a
`SkipStats` when `on_error="skip"` (see memlm.data.stats).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from memlm.data.compression import UNREADABLE, compression, open_binary
from memlm.data.stats import (
    CORRUPT_FILE,
    EMPTY_FILE,
    EMPTY_TEXT,
    INVALID_UTF8,
    MALFORMED_JSON,
    MISSING_FIELD,
    DataError,
    SkipStats,
)
from memlm.errors import ConfigError

__all__ = ["WorkUnit", "expand_paths", "detect_format", "iter_documents", "open_binary", "plan_units", "read_documents"]
EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".txt": "text"}
PARQUET_BATCH = 4096
# What pyarrow raises for a corrupt Parquet file (ArrowInvalid is a ValueError, a bad thrift header an OSError).
_PARQUET_UNREADABLE = (ValueError, OSError, EOFError)


def expand_paths(pattern: str, key: str = "path") -> list[str]:
    """Sorted files matching a path / glob / comma-separated globs; none matching is an error."""
    paths: list[str] = []
    for part in (p.strip() for p in pattern.split(",")):
        if part:
            matches = sorted(glob.glob(os.path.expanduser(part), recursive=True))
            paths.extend(p for p in matches if os.path.isfile(p))
    if not paths:
        raise ConfigError(key, pattern, "a file path or glob that matches at least one file")
    return list(dict.fromkeys(paths))  # keep order, drop files matched by two globs


def detect_format(path: str, fmt: str = "auto") -> str:
    if fmt != "auto":
        return fmt
    stem = path[: -len(ext)] if (ext := compression(path)) else path
    found = EXTENSIONS.get(os.path.splitext(stem)[1].lower())
    if found is None:
        valid = ", ".join(sorted(EXTENSIONS)) + " (optionally + .gz/.zst)"
        raise ConfigError("format", f"auto for {path}", f"a known extension: {valid}, or an explicit format")
    return found


@dataclass(frozen=True)
class WorkUnit:
    """One piece of one file. start/end: byte range (line formats) or row groups (Parquet); end=-1: to the end."""

    source: str
    path: str
    format: str
    text_field: str = "text"
    start: int = 0
    end: int = -1
    index: int = 0  # position in the source's plan; names the shard it becomes

    def spec(self) -> dict:
        """What identifies the unit's input, stored with its shard so resume can tell it is unchanged."""
        st = os.stat(self.path)
        return {
            "path": os.path.abspath(self.path), "format": self.format, "text_field": self.text_field,
            "start": self.start, "end": self.end, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
        }


def plan_units(source: str, paths: list[str], fmt: str, text_field: str, chunk_bytes: int) -> list[WorkUnit]:
    units: list[WorkUnit] = []
    for path in paths:
        kind = detect_format(path, fmt)
        for start, end in _ranges(path, kind, chunk_bytes):
            units.append(WorkUnit(source, path, kind, text_field, start, end, len(units)))
    return units


def _ranges(path: str, kind: str, chunk_bytes: int) -> list[tuple[int, int]]:
    if kind == "parquet":
        meta = _parquet_metadata(path)
        if meta is None:  # unreadable: one unit, whose reading reports it (raise or skip)
            return [(0, -1)]
        ranges, first, size = [], 0, 0
        for i in range(meta.num_row_groups):
            size += meta.row_group(i).total_byte_size
            if size >= chunk_bytes:
                ranges.append((first, i + 1))
                first, size = i + 1, 0
        if first < meta.num_row_groups or not ranges:
            ranges.append((first, meta.num_row_groups))
        return ranges
    size = os.path.getsize(path)
    if kind == "text_file" or compression(path) or size <= chunk_bytes:
        return [(0, -1)]
    return [(s, min(s + chunk_bytes, size)) for s in range(0, size, chunk_bytes)]


def read_documents(unit: WorkUnit, on_error: str, stats: SkipStats) -> Iterator[str]:
    """The documents of one unit, in file order; bad records raise or are counted in `stats`."""
    if unit.format == "parquet":
        docs = _read_parquet(unit, on_error, stats)
    elif unit.format == "text_file":
        docs = _read_text_file(unit, on_error, stats)
    elif unit.format in ("jsonl", "text"):
        docs = _read_lines(unit, on_error, stats)
    else:
        raise ConfigError("format", unit.format, "one of: jsonl, parquet, text, text_file")
    for doc in docs:
        stats.documents += 1
        yield doc


def _describe(err: Exception) -> str:
    """An exception on one line: its type and its message with whitespace collapsed."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _bad(on_error: str, stats: SkipStats, where: str, reason: str, detail: str, count: int = 1) -> None:
    if on_error == "raise":
        raise DataError(where, reason, detail)
    stats.skip(reason, where, count)


class _BrokenStream(Exception):
    """A line reader hit a corrupt or truncated stream at `line` (unit-relative) / decompressed byte `pos`."""

    def __init__(self, line: int, pos: int, err: Exception):
        super().__init__(line, pos, err)
        self.line, self.pos, self.err = line, pos, err


def _iter_lines(unit: WorkUnit) -> Iterator[tuple[int, bytes]]:
    """(line number within the unit, raw line) for the unit's byte range; _BrokenStream where it breaks."""
    n, pos = 0, unit.start
    try:
        with open_binary(unit.path) as fh:
            if unit.start > 0:  # skip the line that began in the previous range
                fh.seek(unit.start - 1)
                fh.readline()
            pos = fh.tell()
            for line in fh:
                if 0 <= unit.end <= pos:
                    return
                pos += len(line)
                n += 1
                yield n, line
    except UNREADABLE as err:
        raise _BrokenStream(n + 1, pos, err) from err


def _line_base(unit: WorkUnit) -> int:
    """Lines before the unit's first line; only computed when an error needs a line number."""
    if unit.start == 0:
        return 0
    count = 0
    with open(unit.path, "rb") as fh:
        fh.seek(unit.start - 1)
        fh.readline()
        limit = fh.tell()
        fh.seek(0)
        while (pos := fh.tell()) < limit:
            count += fh.read(min(1 << 24, limit - pos)).count(b"\n")
    return count


def _read_lines(unit: WorkUnit, on_error: str, stats: SkipStats) -> Iterator[str]:
    """The unit's documents; where the stream breaks, the lines read so far are kept and the rest is bad."""
    try:
        yield from _parse_lines(unit, on_error, stats)
    except _BrokenStream as broken:
        stream = "decompressed stream" if compression(unit.path) else "file"
        kept = f"; the {broken.line - 1} lines before it were read" if broken.line > 1 else ""
        detail = f"the {stream} cannot be read from byte {broken.pos} on ({_describe(broken.err)}){kept}"
        _bad(on_error, stats, f"{unit.path}:{_line_base(unit) + broken.line}", CORRUPT_FILE, detail)


def _parse_lines(unit: WorkUnit, on_error: str, stats: SkipStats) -> Iterator[str]:
    base = None
    seen_any = False
    for n, raw in _iter_lines(unit):
        seen_any = True
        line = raw.rstrip(b"\r\n")
        text = None
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            base = _line_base(unit) if base is None else base
            _bad(on_error, stats, f"{unit.path}:{base + n}", INVALID_UTF8, f"byte {err.start}: {err.reason}")
            continue
        if unit.format == "jsonl":
            if not text.strip():
                base = _line_base(unit) if base is None else base
                stats.skip(EMPTY_TEXT, f"{unit.path}:{base + n}")
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                base = _line_base(unit) if base is None else base
                _bad(on_error, stats, f"{unit.path}:{base + n}", MALFORMED_JSON, str(err))
                continue
            text = record.get(unit.text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                base = _line_base(unit) if base is None else base
                what = "not a JSON object" if not isinstance(record, dict) else (
                    f"field {unit.text_field!r} missing or not a string (keys: {sorted(record)[:8]})")
                _bad(on_error, stats, f"{unit.path}:{base + n}", MISSING_FIELD, what)
                continue
        if not text.strip():  # empty or whitespace-only: blank
            base = _line_base(unit) if base is None else base
            stats.skip(EMPTY_TEXT, f"{unit.path}:{base + n}")
            continue
        yield text
    if not seen_any and unit.start == 0:
        _bad(on_error, stats, unit.path, EMPTY_FILE, "the file holds no data")


def _read_text_file(unit: WorkUnit, on_error: str, stats: SkipStats) -> Iterator[str]:
    try:
        with open_binary(unit.path) as fh:
            data = fh.read()
    except UNREADABLE as err:  # the document is the whole file: a part of it is not kept
        _bad(on_error, stats, unit.path, CORRUPT_FILE, f"the file cannot be read ({_describe(err)})")
        return
    if not data:
        _bad(on_error, stats, unit.path, EMPTY_FILE, "the file holds no data")
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        _bad(on_error, stats, f"{unit.path}:{line}", INVALID_UTF8, f"byte {err.start}: {err.reason}")
        return
    if text.strip():
        yield text
    else:
        stats.skip(EMPTY_TEXT, unit.path)


def _parquet_metadata(path: str):
    """The file's pyarrow FileMetaData, or None when its footer cannot be read."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata
    except _PARQUET_UNREADABLE:
        return None


def _read_parquet(unit: WorkUnit, on_error: str, stats: SkipStats) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(unit.path)
    except _PARQUET_UNREADABLE as err:
        _bad(on_error, stats, unit.path, CORRUPT_FILE,
             f"not a readable Parquet file (footer: {_describe(err)})")
        return
    meta = pf.metadata
    if meta.num_rows == 0:
        _bad(on_error, stats, unit.path, EMPTY_FILE, "the file has no rows")
        return
    if unit.text_field not in pf.schema_arrow.names:
        end = meta.num_row_groups if unit.end < 0 else unit.end
        rows = sum(meta.row_group(i).num_rows for i in range(unit.start, end))
        _bad(on_error, stats, unit.path, MISSING_FIELD,
             f"column {unit.text_field!r} not in columns {pf.schema_arrow.names}", count=rows)
        return
    end = meta.num_row_groups if unit.end < 0 else unit.end
    row = sum(meta.row_group(i).num_rows for i in range(unit.start))
    for group in range(unit.start, end):
        # One row group at a time, so a corrupt group is named and the others are still read.
        group_end = row + meta.row_group(group).num_rows
        try:
            yield from _parquet_rows(pf, group, unit, row, on_error, stats)
        except _BrokenStream as broken:
            _bad(on_error, stats, f"{unit.path}: row group {group}", CORRUPT_FILE,
                 f"rows {broken.line}..{group_end} cannot be read ({_describe(broken.err)})")
        row = group_end


def _parquet_rows(pf, group: int, unit: WorkUnit, row: int, on_error: str, stats: SkipStats) -> Iterator[str]:
    """The documents of one row group, rows numbered from row + 1; _BrokenStream where it breaks."""
    batches = pf.iter_batches(batch_size=PARQUET_BATCH, row_groups=[group], columns=[unit.text_field])
    while True:
        try:
            batch = next(batches, None)
        except _PARQUET_UNREADABLE as err:
            raise _BrokenStream(row + 1, 0, err) from err
        if batch is None:
            return
        for value in batch.column(0).to_pylist():
            row += 1
            where = f"{unit.path}: row {row}"
            if isinstance(value, bytes):  # binary column: decode ourselves to report bad UTF-8 by row
                try:
                    value = value.decode("utf-8")
                except UnicodeDecodeError as err:
                    _bad(on_error, stats, where, INVALID_UTF8, f"byte {err.start}: {err.reason}")
                    continue
            if not isinstance(value, str):
                _bad(on_error, stats, where, MISSING_FIELD, f"column {unit.text_field!r} is {value!r}")
            elif not value.strip():  # empty or whitespace-only: blank
                stats.skip(EMPTY_TEXT, where)
            else:
                yield value


def iter_documents(paths: list[str], fmt: str, text_field: str, on_error: str, stats: SkipStats) -> Iterator[str]:
    """All documents of some files, in order (tokenizer training, small-corpus mode)."""
    for unit in plan_units("", paths, fmt, text_field, chunk_bytes=1 << 62):
        yield from read_documents(unit, on_error, stats)
