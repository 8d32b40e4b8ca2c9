"""Token streams and the mixture schedule: the deterministic core of the loader.

A `TokenSource` turns a source's documents (each ending in EOS) into an
infinite token stream: epoch e is every document once, in an order permuted by
(seed, source name, e), and epochs follow each other without a gap, so packing
never drops a token. Sequences are consecutive windows of that stream, so a
position in the stream (an int) is the whole reading state of a source.

`MixtureSchedule` assigns each *global* sequence index g (counting sequences of
all ranks) to a source: blocks of BLOCK sequences hold each source exactly
round(BLOCK * weight) times (stratified, then shuffled with (seed, block)), so
proportions are exact per block (to 1/BLOCK) and the choice depends on g alone, not on the
world size or on which rank asks.
"""

from __future__ import annotations

import zlib

import numpy as np

from memlm.errors import ConfigError

BLOCK = 4096
EPOCH_TABLES_KEPT = 2  # a batch can straddle one epoch boundary per source


class TokenSource:
    """An infinite, epoch-shuffled token stream over documents stored in one or more token arrays."""

    def __init__(self, name: str, shards: list[tuple[np.ndarray, np.ndarray]], seed: int, shuffle: bool = True):
        # shards: (tokens (n_tokens,), offsets (n_docs + 1,)) per array, e.g. memory-mapped .bin files
        self.name = name
        self.arrays = [tokens for tokens, _ in shards]
        self.doc_len = np.concatenate([np.diff(o) for _, o in shards] or [np.empty(0, np.int64)]).astype(np.int64)
        self.doc_start = np.concatenate([o[:-1] for _, o in shards] or [np.empty(0, np.int64)]).astype(np.int64)
        self.doc_array = np.concatenate(
            [np.full(len(o) - 1, i, dtype=np.int32) for i, (_, o) in enumerate(shards)] or [np.empty(0, np.int32)])
        self.tokens_per_epoch = int(self.doc_len.sum())
        if self.tokens_per_epoch == 0:
            raise ConfigError(f"data.sources[{name}]", "no tokens in this split",
                              "a source with at least one non-empty document in the split read")
        self.seed = seed
        self.shuffle = shuffle
        self._tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def num_docs(self) -> int:
        return len(self.doc_len)

    def _table(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, cumulative token offsets of that order (n_docs + 1,)) of one epoch."""
        if epoch not in self._tables:
            n = self.num_docs
            if self.shuffle:
                key = [self.seed, zlib.crc32(self.name.encode()), epoch]
                order = np.random.default_rng(key).permutation(n).astype(np.int64)
            else:
                order = np.arange(n, dtype=np.int64)
            cum = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(self.doc_len[order], out=cum[1:])
            if len(self._tables) >= EPOCH_TABLES_KEPT:
                del self._tables[min(self._tables)]
            self._tables[epoch] = (order, cum)
        return self._tables[epoch]

    def fill_rows(self, starts: list[int], out: np.ndarray) -> None:
        """out[j] = the len(out[j]) tokens at stream position starts[j]; out: (rows, width)."""
        # Cut each row into pieces that stay inside one epoch (usually one piece), then, per epoch,
        # find every document segment of every piece with vectorized searchsorted: no per-token Python.
        assert out.flags.c_contiguous, "fill_rows writes through a flat view of out"
        width = out.shape[1]
        by_epoch: dict[int, list[tuple[int, int, int]]] = {}  # epoch -> (flat dest, offset, length)
        for j, pos in enumerate(starts):
            dest, left = j * width, width
            while left:
                epoch, offset = divmod(pos, self.tokens_per_epoch)
                take = min(left, self.tokens_per_epoch - offset)
                by_epoch.setdefault(epoch, []).append((dest, offset, take))
                dest, pos, left = dest + take, pos + take, left - take
        flat = out.reshape(-1)
        for epoch, pieces in by_epoch.items():
            self._copy_pieces(epoch, np.array(pieces, dtype=np.int64), flat)

    def fill_documents(self, numbers: np.ndarray, out: np.ndarray) -> np.ndarray:
        """out[j, :len] = document numbers[j] of the stream (epoch-major: number k is document k % n of
        epoch k // n, in that epoch's order); return the lengths (rows,). The rest of out is left as is."""
        lengths = np.empty(len(numbers), dtype=np.int64)
        for j, k in enumerate(numbers.tolist()):
            epoch, i = divmod(k, self.num_docs)
            doc = int(self._table(epoch)[0][i])
            start, n = int(self.doc_start[doc]), int(self.doc_len[doc])
            out[j, :n] = self.arrays[self.doc_array[doc]][start:start + n]
            lengths[j] = n
        return lengths

    def _copy_pieces(self, epoch: int, pieces: np.ndarray, flat: np.ndarray) -> None:
        # pieces: (k, 3) = flat destination, epoch offset, length
        order, cum = self._table(epoch)
        dest, lo, n = pieces[:, 0], pieces[:, 1], pieces[:, 2]
        first = np.searchsorted(cum, lo, side="right") - 1
        count = np.searchsorted(cum, lo + n, side="left") - first  # documents each piece touches
        piece = np.repeat(np.arange(len(pieces)), count)
        idx = np.arange(len(piece)) - np.repeat(np.cumsum(count) - count, count) + first[piece]
        seg_lo = np.maximum(cum[idx], lo[piece])
        seg_len = np.minimum(cum[idx + 1], lo[piece] + n[piece]) - seg_lo
        docs = order[idx]
        src = self.doc_start[docs] + (seg_lo - cum[idx])
        dst = dest[piece] + (seg_lo - lo[piece])
        if len(self.arrays) == 1:  # one gather for the whole batch
            shift = np.repeat(src - dst, seg_len)
            at = np.repeat(dst, seg_len) + (np.arange(len(shift)) - np.repeat(np.cumsum(seg_len) - seg_len, seg_len))
            flat[at] = self.arrays[0][at + shift]
            return
        arrays = self.arrays
        for a, s, d, m in zip(self.doc_array[docs].tolist(), src.tolist(), dst.tolist(), seg_len.tolist()):
            flat[d:d + m] = arrays[a][s:s + m]


class RandomTokens:
    """Uniform random tokens in [0, vocab_size): the `random` data kind. Deterministic in (seed, position)."""

    tokens_per_epoch = 1 << 62  # never wraps
    num_docs = 0

    def __init__(self, name: str, vocab_size: int, seed: int | list[int]):
        self.name = name
        self.vocab_size = vocab_size
        self.seed = seed

    def fill_rows(self, starts: list[int], out: np.ndarray) -> None:
        for j, pos in enumerate(starts):
            key = [*self.seed, pos] if isinstance(self.seed, list) else [self.seed, pos]
            out[j] = np.random.default_rng(key).integers(0, self.vocab_size, out.shape[1])


class MixtureSchedule:
    """Which source each global sequence index comes from (see module docstring)."""

    def __init__(self, weights: list[float], seed: int):
        w = np.asarray(weights, dtype=np.float64)
        if len(w) == 0 or not np.all(w > 0):
            raise ConfigError("data.sources.weight", list(weights), "at least one source, every weight > 0")
        exact = BLOCK * w / w.sum()
        counts = np.floor(exact).astype(np.int64)
        # Largest remainders get the leftover slots, so every block has exactly BLOCK entries.
        leftover = BLOCK - counts.sum()
        counts[np.argsort(-(exact - counts), kind="stable")[:leftover]] += 1
        if not np.all(counts > 0):
            raise ConfigError("data.sources.weight", list(weights),
                              f"weights of at least 1/{BLOCK} of the total each (a smaller one is never sampled)")
        self.pattern = np.repeat(np.arange(len(w), dtype=np.int16), counts)
        self.weights = w / w.sum()
        self.seed = seed
        self._cache: dict[int, np.ndarray] = {}

    def _block(self, k: int) -> np.ndarray:
        if k not in self._cache:
            if len(self._cache) >= 4:
                del self._cache[min(self._cache)]
            block = self.pattern.copy()
            if len(self.weights) > 1:
                np.random.default_rng([self.seed, 0x6D6978, k]).shuffle(block)
            self._cache[k] = block
        return self._cache[k]

    def choices(self, start: int, n: int) -> np.ndarray:
        """Source index of global sequences [start, start + n)."""
        first, last = start // BLOCK, (start + n - 1) // BLOCK
        blocks = np.concatenate([self._block(k) for k in range(first, last + 1)])
        offset = start - first * BLOCK
        return blocks[offset:offset + n]
