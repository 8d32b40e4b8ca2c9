"""Corrupt inputs (issue 21, item 7): each names the file; under on_error=skip it is counted, not fatal.

Truncated or garbage compressed files and Parquet files raise `DataError` naming
the file (and line or row group) with on_error=raise; with on_error=skip the
unreadable file, remainder or row group is counted as `corrupt_file` and every
record read before the break is kept. A garbage tokenizer, manifest.json or
shard index gives a `ConfigError` naming the file.
"""

from __future__ import annotations

import gzip
import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from memlm.data.config import SourceConfig
from memlm.data.prepare import prepare
from memlm.data.shards import MANIFEST, load_split, read_manifest
from memlm.data.sources import iter_documents
from memlm.data.stats import CORRUPT_FILE, DataError, SkipStats
from memlm.data.tokenizer import Tokenizer, train_tokenizer
from memlm.errors import ConfigError

# Random words compress poorly, so a truncated stream still holds whole blocks (and lines) before the cut.
_rng = random.Random(0)
DOCS = [f"doc {i} " + " ".join(f"{_rng.getrandbits(40):x}" for _ in range(8)) for i in range(4000)]
GOOD = ["a good document", "another good one"]


def _jsonl(docs) -> bytes:
    return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


def _read(paths, on_error):
    stats = SkipStats()
    docs = []
    try:
        for doc in iter_documents([str(p) for p in paths], "auto", "text", on_error, stats):
            docs.append(doc)
    except DataError as err:
        return docs, stats, err
    return docs, stats, None


def _corrupt_then_good(tmp_path, name: str, data: bytes):
    bad = tmp_path / name
    bad.write_bytes(data)
    good = tmp_path / "z-good.jsonl"
    good.write_bytes(_jsonl(GOOD))
    return bad, good


def _check_raise_and_skip(bad, good, where: str, kept_prefix: bool):
    docs, _, err = _read([bad, good], "raise")
    assert err is not None, f"{bad} read without an error"
    assert str(bad) in str(err) and err.reason == CORRUPT_FILE and err.where.startswith(where)
    docs, stats, err = _read([bad, good], "skip")
    assert err is None
    assert stats.skipped == {CORRUPT_FILE: 1} and stats.examples[CORRUPT_FILE][0].startswith(where)
    assert docs[-len(GOOD):] == GOOD  # reading goes on with the next file
    kept = docs[: -len(GOOD)]
    if kept_prefix:  # every record before the break is kept, in order, none after it
        assert 0 < len(kept) < len(DOCS) and kept == DOCS[: len(kept)]
    else:
        assert kept == []
    assert stats.documents == len(docs)
    assert CORRUPT_FILE in stats.summary()


def test_truncated_gz(tmp_path):
    data = gzip.compress(_jsonl(DOCS))
    bad, good = _corrupt_then_good(tmp_path, "a.jsonl.gz", data[: len(data) * 2 // 3])
    _check_raise_and_skip(bad, good, f"{bad}:", kept_prefix=True)


def test_truncated_zst(tmp_path):
    # zstandard's stream reader ends quietly at the cut: the tail would vanish without this check.
    data = zstandard.ZstdCompressor().compress(_jsonl(DOCS))
    bad, good = _corrupt_then_good(tmp_path, "a.jsonl.zst", data[: len(data) * 2 // 3])
    _check_raise_and_skip(bad, good, f"{bad}:", kept_prefix=True)


@pytest.mark.parametrize("name", ["a.jsonl.zst", "a.jsonl.gz", "a.txt.zst"])
def test_garbage_compressed(tmp_path, name):
    bad, good = _corrupt_then_good(tmp_path, name, random.Random(1).randbytes(3000))
    _check_raise_and_skip(bad, good, f"{bad}:1", kept_prefix=False)


def test_concatenated_zst_frames_read_whole(tmp_path):
    path = tmp_path / "a.jsonl.zst"
    cctx = zstandard.ZstdCompressor()
    path.write_bytes(cctx.compress(_jsonl(DOCS[:10])) + cctx.compress(_jsonl(DOCS[10:20])))
    docs, stats, err = _read([path], "raise")
    assert err is None and docs == DOCS[:20] and not stats.skipped


def _parquet(path, row_group_size=400):
    pq.write_table(pa.table({"text": DOCS[:2000]}), path, row_group_size=row_group_size)
    return path.read_bytes()


@pytest.mark.parametrize("cut", ["garbage", "truncated"])
def test_unreadable_parquet(tmp_path, cut):
    data = _parquet(tmp_path / "src.parquet")
    data = random.Random(2).randbytes(5000) if cut == "garbage" else data[: len(data) // 2]
    bad, good = _corrupt_then_good(tmp_path, "a.parquet", data)
    _check_raise_and_skip(bad, good, str(bad), kept_prefix=False)


def test_corrupt_parquet_row_group(tmp_path):
    src = tmp_path / "src.parquet"
    data = bytearray(_parquet(src))
    column = pq.ParquetFile(src).metadata.row_group(2).column(0)
    start = column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset
    data[start:start + 8] = b"\xff" * 8  # the first page header of row group 2: unreadable
    bad = tmp_path / "a.parquet"
    bad.write_bytes(bytes(data))
    docs, _, err = _read([bad], "raise")
    assert err is not None and err.where == f"{bad}: row group 2" and "rows 801..1200" in str(err)
    assert docs == DOCS[:800]
    docs, stats, err = _read([bad], "skip")
    assert err is None and stats.skipped == {CORRUPT_FILE: 1}
    assert docs == DOCS[:800] + DOCS[1200:2000]  # the other row groups are kept


def test_whitespace_only_lines_are_blank(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("alpha\n \t \n\r\nbeta\n   \n", encoding="utf-8")
    docs, stats, err = _read([path], "raise")
    assert err is None and docs == ["alpha", "beta"]
    assert stats.skipped == {"empty_text": 3}
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_bytes(_jsonl(["x", "  \n\t"]))
    docs, stats, _ = _read([jsonl], "raise")
    assert docs == ["x"] and stats.skipped == {"empty_text": 1}


def test_prepare_reports_corrupt_file(tmp_path):
    """The skip reaches the manifest and summary like every other; raise names the file from prepare."""
    data = gzip.compress(_jsonl(DOCS))
    bad = tmp_path / "a.jsonl.gz"
    bad.write_bytes(data[: len(data) // 2])
    tok = train_tokenizer(GOOD * 20 + DOCS[:200], str(tmp_path / "tok.model"), vocab_size=300)
    sources = [SourceConfig(name="web", path=str(bad))]
    with pytest.raises(DataError, match=str(bad)):
        prepare(sources, tok.path, str(tmp_path / "out-raise"), val_fraction=0.0, show_progress=False)
    manifest = prepare(sources, tok.path, str(tmp_path / "out"), val_fraction=0.0, on_error="skip",
                       show_progress=False)
    stats = manifest["sources"]["web"]["stats"]
    assert stats["skipped"] == {CORRUPT_FILE: 1} and stats["examples"][CORRUPT_FILE][0].startswith(f"{bad}:")
    assert 0 < stats["documents"] < len(DOCS) and manifest["sources"]["web"]["docs"]["train"] == stats["documents"]


@pytest.mark.parametrize("content", [b"garbage" * 10, b""], ids=["garbage", "empty"])
def test_garbage_tokenizer_names_the_file(tmp_path, content):
    path = tmp_path / "tok.model"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=str(path)):
        Tokenizer(str(path))


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    (root / "a.jsonl").write_bytes(_jsonl(DOCS[:300]))
    tok = train_tokenizer(DOCS[:300], str(root / "tok.model"), vocab_size=300)
    prepare([SourceConfig(name="a", path=str(root / "a.jsonl"))], tok.path, str(root / "out"),
            val_fraction=0.0, show_progress=False)
    return root / "out"


def _copy(shards, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(shards, out)
    return out


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'{"version": 1}', b"\xff\xfe"],
                         ids=["not-json", "list", "keys-missing", "not-utf8"])
def test_garbage_manifest_names_the_file(shards, tmp_path, content):
    out = _copy(shards, tmp_path)
    (out / MANIFEST).write_bytes(content)
    with pytest.raises(ConfigError, match=str(out / MANIFEST)):
        read_manifest(str(out))


@pytest.mark.parametrize("cut", ["truncated", "header"])
def test_truncated_index_names_the_file(shards, tmp_path, cut):
    out = _copy(shards, tmp_path)
    manifest = read_manifest(str(out))
    index = out / "a" / manifest["sources"]["a"]["shards"]["train"][0]["index"]
    data = index.read_bytes()
    index.write_bytes(data[: len(data) - 16] if cut == "truncated" else data[:40])
    with pytest.raises(ConfigError, match=str(index)):
        load_split(str(out), manifest, "a", "train")
    assert np.load(shards / "a" / index.name).ndim == 1  # the original is intact
