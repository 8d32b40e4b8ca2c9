"""Engram's token-id compression: a map from a tokenizer's ids to canonical ids, built once.

Tokens that differ only in case, accents, Unicode width forms or whitespace get
one canonical id, so Engram's n-grams (memory/engram.py) address one row for
all of them. The map is a function of the vocabulary's pieces alone:

    pieces = [sp.id_to_piece(i) for i in range(sp.vocab_size())]  # any sentencepiece model
    token_map = canonical_map(pieces)             # (vocab_size,) int64: id -> canonical id
    save_canonical_map("tok.engram_map.json", token_map)   # beside the tokenizer
    token_map = load_canonical_map("tok.engram_map.json")

Normalization of one piece (`normalize_piece`; docs/memory.md, "Engram"):
    sentencepiece's word marker U+2581 -> " "; NFKC; NFD and every combining mark
    (category Mn) dropped; lowercase; each run of whitespace -> one " "; stripped,
    unless nothing but whitespace was there (then " ").
A byte-fallback piece (`<0x41>`) keeps its own text, and so does a piece that
normalizes to "". Canonical ids are numbered in order of first appearance, so
id 0's canonical id is 0 and the map is the same on every machine.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import unicodedata
from collections.abc import Sequence

import torch

from memlm.errors import ConfigError

SP_SPACE = "\u2581"  # sentencepiece's whitespace marker ("▁the")
BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # byte-fallback pieces stand for raw bytes, not text
WHITESPACE = re.compile(r"\s+")
FORMAT = "memlm-engram-canonical-map"  # the JSON file's "format" field
VERSION = 1


def normalize_piece(piece: str) -> str:
    """A piece's canonical text (module docstring): "▁The" -> "the", "Ｃａｆé" -> "cafe"."""
    if BYTE_PIECE.fullmatch(piece):
        return piece
    text = unicodedata.normalize("NFKC", piece.replace(SP_SPACE, " "))
    text = "".join(ch for ch in unicodedata.normalize("NFD", text) if unicodedata.category(ch) != "Mn")
    text = WHITESPACE.sub(" ", text.lower())
    if text == " ":  # a whitespace-only piece stays one space
        return text
    return text.strip() or piece


def canonical_map(pieces: Sequence[str]) -> torch.Tensor:
    """pieces (vocab order) -> (len(pieces),) int64: token id -> canonical id (first appearance order)."""
    if len(pieces) == 0:
        raise ValueError("pieces=[] is invalid: the tokenizer's pieces in id order (at least one)")
    ids: dict[str, int] = {}
    out = [ids.setdefault(normalize_piece(p), len(ids)) for p in pieces]
    return torch.tensor(out, dtype=torch.int64)


def save_canonical_map(path: str | os.PathLike, token_map: torch.Tensor) -> None:
    """Write `token_map` as JSON (written to a temporary file, then renamed: never half a file)."""
    values = check_canonical_map(token_map, "token_map").tolist()
    body = {"format": FORMAT, "version": VERSION, "vocab_size": len(values),
            "canonical_vocab": max(values) + 1, "map": values}
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".engram_map.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(body, fh, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load_canonical_map(path: str | os.PathLike) -> torch.Tensor:
    """The map `save_canonical_map` wrote at `path`, as (vocab_size,) int64; a ConfigError on any fault."""
    valid = f"a JSON file written by memlm.memory.engram_vocab.save_canonical_map ({FORMAT} v{VERSION})"
    try:
        with open(path, encoding="utf-8") as fh:
            body = json.load(fh)
    except (OSError, ValueError) as err:
        raise ConfigError("token_map", str(path), f"{valid}; reading it failed: {err}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") != VERSION:
        raise ConfigError("token_map", str(path), f"{valid}; this file has another format")
    values = body.get("map")
    if not isinstance(values, list) or not all(type(v) is int for v in values) or len(values) != body.get("vocab_size"):
        raise ConfigError("token_map", str(path), f"{valid}; its map is not a list of vocab_size integers")
    try:
        return check_canonical_map(torch.tensor(values, dtype=torch.int64), "token_map")
    except ValueError as err:
        raise ConfigError("token_map", str(path), f"{valid}; {err}") from None


def check_canonical_map(token_map: torch.Tensor, key: str) -> torch.Tensor:
    """`token_map` if it is a non-empty 1-D integer tensor of ids in [0, len(token_map)); else a ValueError
    naming `key` (a map numbers at most one canonical id per token, and the hash pads with len(token_map))."""
    if not isinstance(token_map, torch.Tensor) or token_map.dim() != 1 or token_map.numel() == 0 \
            or token_map.dtype not in (torch.int32, torch.int64):
        what = tuple(token_map.shape) if isinstance(token_map, torch.Tensor) else type(token_map).__name__
        raise ValueError(f"{key}={what} is invalid: a non-empty 1-D int64 tensor (token id -> canonical id)")
    low, high = int(token_map.min()), int(token_map.max())
    if low < 0 or high >= token_map.numel() or token_map.numel() >= 2**31:
        raise ValueError(f"{key} holds ids in [{low}, {high}] for {token_map.numel()} tokens: canonical ids "
                         "must be in [0, vocab_size), vocab_size < 2**31")
    return token_map.to(torch.int64)
