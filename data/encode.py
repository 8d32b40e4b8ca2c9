"""Tokenize one work unit into EOS-terminated token arrays, split into train / val by document hash.

Shared by preparation (which writes the arrays as shards) and the small-corpus
mode (which keeps them in memory), so both produce identical token streams.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from memlm.data.shards import SPLITS
from memlm.data.sources import WorkUnit, read_documents
from memlm.data.stats import SkipStats
from memlm.data.tokenizer import Tokenizer

BATCH_DOCS = 256


def is_validation(text: str, fraction: float) -> bool:
    """Deterministic held-out choice: the document's hash falls in the first `fraction` of the hash range."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


@dataclass
class EncodedUnit:
    unit: WorkUnit
    # split -> (tokens (n_tokens,), document offsets (n_docs + 1,) int64)
    splits: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    stats: SkipStats = field(default_factory=SkipStats)


def pack_documents(ids: list[list[int]], eos_id: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate token lists, each followed by EOS; return (tokens, lengths incl. EOS)."""
    lens = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    ends = np.cumsum(lens)
    out = np.empty(int(ends[-1]) if len(ids) else 0, dtype=dtype)
    keep = np.ones(len(out), dtype=bool)
    keep[ends - 1] = False
    out[ends - 1] = eos_id
    out[keep] = np.fromiter(chain.from_iterable(ids), dtype=dtype, count=len(out) - len(ids))
    return out, lens


def encode_unit(
    unit: WorkUnit,
    tokenizer: Tokenizer,
    on_error: str,
    val_fraction: float,
    dtype: np.dtype,
    progress: Callable[[int, int], None] | None = None,
) -> EncodedUnit:
    """Read, split and tokenize one unit. progress(docs, tokens) is called after every batch."""
    result = EncodedUnit(unit)
    parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {s: [] for s in SPLITS}
    batch: dict[str, list[str]] = {s: [] for s in SPLITS}

    def flush(split: str) -> None:
        texts = batch[split]
        if texts:
            tokens, lens = pack_documents(tokenizer.encode_batch(texts), tokenizer.eos_id, dtype)
            parts[split].append((tokens, lens))
            if progress is not None:
                progress(len(texts), len(tokens))
            texts.clear()

    for text in read_documents(unit, on_error, result.stats):
        split = "val" if is_validation(text, val_fraction) else "train"
        batch[split].append(text)
        if len(batch[split]) >= BATCH_DOCS:
            flush(split)
    for split in SPLITS:
        flush(split)
        tokens = np.concatenate([t for t, _ in parts[split]]) if parts[split] else np.empty(0, dtype)
        lens = np.concatenate([n for _, n in parts[split]]) if parts[split] else np.empty(0, np.int64)
        result.splits[split] = (tokens, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
    return result
