"""Streaming readers for .gz / .zst inputs that fail loudly on a corrupt or truncated stream.

    with open_binary("raw/web-000.jsonl.zst") as fh:
        for line in fh: ...          # raises one of UNREADABLE where the stream breaks

Python's gzip reader raises `EOFError` on a truncated stream, but zstandard's
`stream_reader` returns the decompressed prefix and then a clean end of file,
so a truncated `.zst` would silently lose its tail. `ZstdReader` decodes frame
by frame and raises `EOFError` when the input ends inside a frame. Readers of
sources catch `UNREADABLE` and turn it into a `DataError` naming the file and
line (or count it under `on_error=skip`).
"""

from __future__ import annotations

import gzip
import io
import zlib

import zstandard

COMPRESSIONS = (".gz", ".zst")
READ_CHUNK = 1 << 17
# What a corrupt or truncated input raises while it is read (gzip.BadGzipFile is an OSError).
UNREADABLE = (EOFError, OSError, zlib.error, zstandard.ZstdError)


def compression(path: str) -> str:
    """'.gz', '.zst' or '' from the file name."""
    return next((c for c in COMPRESSIONS if path.lower().endswith(c)), "")


def open_binary(path: str) -> io.BufferedIOBase:
    """A streaming binary reader that undoes .gz / .zst compression."""
    comp = compression(path)
    if comp == ".gz":
        return gzip.open(path, "rb")
    if comp == ".zst":
        return io.BufferedReader(ZstdReader(open(path, "rb")))  # noqa: SIM115 (closed with the wrapper)
    return open(path, "rb")


class ZstdReader(io.RawIOBase):
    """Decompresses concatenated zstd frames from `raw`; EOFError if the input ends inside a frame."""

    def __init__(self, raw: io.BufferedIOBase):
        super().__init__()
        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._frame = None  # the decompressor of the frame being read; None between frames
        self._out = memoryview(b"")  # decompressed bytes not yet returned
        self._pos = 0  # decompressed bytes returned

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        while not self._out:
            chunk = self._raw.read(READ_CHUNK)
            if not chunk:
                if self._frame is not None and not self._frame.eof:
                    raise EOFError(f"zstd stream ends inside a frame (input truncated at byte {self._raw.tell()})")
                return 0
            self._out = memoryview(self._feed(chunk))
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]  # a view: no copy of the rest
        self._pos += n
        return n

    def _feed(self, data: bytes) -> bytes:
        out = []
        while data:
            if self._frame is None or self._frame.eof:  # a new frame starts here
                self._frame = self._dctx.decompressobj()
            out.append(self._frame.decompress(data))
            data = self._frame.unused_data if self._frame.eof else b""
        return b"".join(out)

    def close(self) -> None:
        self._raw.close()
        super().close()
