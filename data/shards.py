"""Token shards on disk: the layout written by memlm.data.prepare and read (memory-mapped) by the loader.

    <shards_dir>/manifest.json                   what follows, plus the tokenizer (path, sha256, vocab, ids)
    <shards_dir>/<source>/<split>-<unit>.bin     tokens of the unit's documents, each followed by EOS;
                                                 uint16 when vocab_size <= 65536, else uint32
    <shards_dir>/<source>/<split>-<unit>.idx.npy int64 document boundaries into the .bin (n_docs + 1)
    <shards_dir>/<source>/unit-<unit>.json       written last: the unit is finished (input spec, counts)

Every file is written to a temporary name and renamed, so a crash never leaves
a half-written file under a final name; an interrupted preparation resumes by
skipping units whose `.json` matches their input and tokenizer.
"""

from __future__ import annotations

import json
import os

import numpy as np

from memlm.data.tokenizer import Tokenizer
from memlm.errors import ConfigError
from memlm.files import atomic_output, atomic_write_bytes, atomic_write_json

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
MANIFEST_KEYS = ("version", "tokenizer", "dtype", "sources")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def write_json(path: str, obj: dict) -> None:
    """The layout's JSON files (manifest, unit records): sorted keys, one per line."""
    atomic_write_json(path, obj, indent=1, sort_keys=True)


def write_shard(folder: str, stem: str, tokens: np.ndarray, offsets: np.ndarray) -> dict:
    """Write `<stem>.bin` and `<stem>.idx.npy` into folder; return the manifest entry."""
    # tokens: (n_tokens,) uint16/uint32; offsets: (n_docs + 1,) int64 starting at 0
    atomic_write_bytes(os.path.join(folder, f"{stem}.bin"), tokens.tobytes())
    idx = os.path.join(folder, f"{stem}.idx.npy")
    with atomic_output(idx, suffix=".npy") as tmp:  # np.save appends .npy to any other name
        np.save(tmp, offsets.astype(np.int64))
    return {"bin": f"{stem}.bin", "index": f"{stem}.idx.npy", "docs": len(offsets) - 1, "tokens": int(offsets[-1])}


def read_manifest(shards_dir: str) -> dict:
    path = os.path.join(shards_dir, MANIFEST)
    if not os.path.isfile(path):
        raise ConfigError("data.shards_dir", shards_dir,
                          f"a folder holding {MANIFEST}: "
                          f"run `python -m memlm.data.prepare --out {shards_dir} ...` first")
    try:
        with open(path, "rb") as fh:
            manifest = json.loads(fh.read())
    except (ValueError, OSError) as err:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise ConfigError("data.shards_dir", shards_dir,
                          f"a readable {MANIFEST}: {path} is not valid JSON ({err}); re-run prepare") from None
    missing = [k for k in MANIFEST_KEYS if k not in manifest] if isinstance(manifest, dict) else list(MANIFEST_KEYS)
    if missing:
        raise ConfigError("data.shards_dir", shards_dir,
                          f"a {MANIFEST} written by prepare: {path} lacks {', '.join(missing)}; re-run prepare")
    if manifest.get("version") != FORMAT_VERSION:
        raise ConfigError("data.shards_dir", shards_dir,
                          f"shards of format version {FORMAT_VERSION} (found {manifest.get('version')}); "
                          "re-run prepare")
    return manifest


def check_tokenizer(manifest: dict, tokenizer: Tokenizer, shards_dir: str) -> None:
    """Shards are only valid with the exact tokenizer that made them."""
    made_with = manifest["tokenizer"]
    if made_with["sha256"] != tokenizer.sha256:
        raise ConfigError(
            "data.tokenizer", tokenizer.path,
            f"the tokenizer the shards in {shards_dir} were made with: they record {made_with['path']} "
            f"(sha256 {made_with['sha256'][:16]}...), but {tokenizer.path} has sha256 {tokenizer.sha256[:16]}... "
            "(tokenizer hash mismatch: re-run prepare with this tokenizer, or point data.tokenizer at that one)",
        )


def open_tokens(path: str, dtype: np.dtype) -> np.ndarray:
    """The tokens of a .bin as a read-only array backed by the page cache (np.memmap)."""
    if os.path.getsize(path) == 0:  # mmap cannot map an empty file
        return np.empty(0, dtype=dtype)
    # A plain ndarray view: slicing it is several times cheaper than slicing np.memmap.
    return np.memmap(path, dtype=dtype, mode="r").view(np.ndarray)


def read_index(path: str, shards_dir: str) -> np.ndarray:
    """A shard's document offsets (n_docs + 1,) int64; a truncated or garbage file is an error naming it."""
    try:
        offsets = np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ConfigError("data.shards_dir", shards_dir,
                          f"intact shards: the index {path} cannot be read ({err}); re-run prepare") from None
    if offsets.ndim != 1 or offsets.dtype != np.int64 or len(offsets) == 0:
        raise ConfigError("data.shards_dir", shards_dir,
                          f"intact shards: the index {path} holds {offsets.dtype} {offsets.shape}, "
                          "not int64 document offsets; re-run prepare")
    return offsets


def load_split(shards_dir: str, manifest: dict, source: str, split: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, document offsets) per shard of one source and split."""
    sources = manifest["sources"]
    if source not in sources:
        raise ConfigError("data.sources.name", source,
                          f"a source prepared in {shards_dir}: {', '.join(sorted(sources))}")
    if split not in SPLITS:
        raise ConfigError("split", split, f"one of: {', '.join(SPLITS)}")
    dtype = np.dtype(manifest["dtype"])
    folder = os.path.join(shards_dir, source)
    shards = []
    for entry in sources[source]["shards"][split]:
        path = os.path.join(folder, entry["bin"])
        if not os.path.isfile(path):
            raise ConfigError("data.shards_dir", shards_dir,
                              f"intact shards: {path}, named by its {MANIFEST}, is missing; re-run prepare")
        tokens = open_tokens(path, dtype)
        offsets = read_index(os.path.join(folder, entry["index"]), shards_dir)
        if len(tokens) != entry["tokens"] or offsets[-1] != len(tokens) or len(offsets) != entry["docs"] + 1:
            raise ConfigError("data.shards_dir", shards_dir,
                              f"intact shards: {folder}/{entry['bin']} has {len(tokens)} tokens, its index "
                              f"and the manifest say {int(offsets[-1])} / {entry['tokens']}; re-run prepare")
        shards.append((tokens, offsets))
    return shards
