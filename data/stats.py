"""Bad-input accounting: the error raised for a bad record and the counts of skipped ones.

With `on_error=raise` the first bad record raises `DataError` naming file and
line. With `on_error=skip` it is counted in `SkipStats` under its reason (with
the first few locations as examples) and the count is reported at the end of
every command and when a loader is built: nothing is dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memlm.errors import MemlmError

# Reasons a record is not turned into a document.
MALFORMED_JSON = "malformed_json"
MISSING_FIELD = "missing_field"  # field/column absent, null, or not a string
INVALID_UTF8 = "invalid_utf8"
EMPTY_FILE = "empty_file"
EMPTY_TEXT = "empty_text"  # empty or whitespace-only document / line: always skipped, but counted
# A file, the rest of a file or a Parquet row group that cannot be read (truncated or corrupt
# compressed stream or Parquet file): counted once per unreadable piece; what was read before it is kept.
CORRUPT_FILE = "corrupt_file"
MAX_EXAMPLES = 3


class DataError(MemlmError, ValueError):
    """A bad input record or file: `where` is "file:line", "file: row N", "file: row group G" or "file".
    A rank reads its own part of the data, so each rank that meets one says so."""

    same_on_every_rank = False

    def __init__(self, where: str, reason: str, detail: str):
        self.where = where
        self.reason = reason
        self.detail = detail
        super().__init__(
            f"{where}: {reason.replace('_', ' ')}: {detail} "
            "(fix the input, or set data.on_error=skip / --on-error skip to count and skip such records)"
        )

    def __reduce__(self):  # rebuild from the fields when raised in a worker process
        return DataError, (self.where, self.reason, self.detail)


@dataclass
class SkipStats:
    """Documents read and records skipped, per reason. Mergeable across workers."""

    documents: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def skip(self, reason: str, where: str, count: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + count
        examples = self.examples.setdefault(reason, [])
        if len(examples) < MAX_EXAMPLES:
            examples.append(where)

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped.values())

    def merge(self, other: SkipStats) -> SkipStats:
        self.documents += other.documents
        for reason, count in other.skipped.items():
            self.skipped[reason] = self.skipped.get(reason, 0) + count
            room = MAX_EXAMPLES - len(self.examples.setdefault(reason, []))
            self.examples[reason].extend(other.examples.get(reason, [])[:max(room, 0)])
        return self

    def to_dict(self) -> dict:
        return {"documents": self.documents, "skipped": dict(self.skipped), "examples": dict(self.examples)}

    @classmethod
    def from_dict(cls, d: dict) -> SkipStats:
        return cls(d.get("documents", 0), dict(d.get("skipped", {})), dict(d.get("examples", {})))

    def summary(self) -> str:
        if not self.skipped:
            return f"{self.documents:,} documents, nothing skipped"
        parts = [
            f"{reason}={count:,} (e.g. {', '.join(self.examples.get(reason, []))})"
            for reason, count in sorted(self.skipped.items())
        ]
        return f"{self.documents:,} documents, skipped {self.total_skipped:,}: " + "; ".join(parts)
