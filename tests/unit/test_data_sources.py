"""Document sources: every format read from files written here, and every kind of bad input."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from memlm.data.sources import expand_paths, iter_documents, plan_units, read_documents
from memlm.data.stats import DataError, SkipStats
from memlm.errors import ConfigError

DOCS = ["first document", "zweites Dokument: äöü", "第三个文档 🚀", "line one\nline two"]


def _jsonl(docs, field="text"):
    return "".join(json.dumps({field: d, "id": i}, ensure_ascii=False) + "\n" for i, d in enumerate(docs)).encode()


def _read(paths, fmt="auto", field="text", on_error="raise"):
    stats = SkipStats()
    return list(iter_documents([str(p) for p in paths], fmt, field, on_error, stats)), stats


def test_jsonl_plain_gz_zst(tmp_path):
    raw = _jsonl(DOCS)
    (tmp_path / "a.jsonl").write_bytes(raw)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst"):
        docs, stats = _read([tmp_path / name])
        assert docs == DOCS, name
        assert stats.documents == len(DOCS) and not stats.skipped


def test_jsonl_custom_text_field(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(_jsonl(DOCS, field="content"))
    assert _read([tmp_path / "a.jsonl"], field="content")[0] == DOCS


def test_parquet_streams_row_groups(tmp_path):
    path = tmp_path / "a.parquet"
    many = [f"doc {i} {DOCS[i % 4]}" for i in range(50)]
    pq.write_table(pa.table({"body": many, "n": list(range(50))}), path, row_group_size=7)
    assert _read([path], field="body")[0] == many
    units = plan_units("s", [str(path)], "auto", "body", chunk_bytes=1)  # one unit per row group
    assert len(units) == 8
    pieces = [d for u in units for d in read_documents(u, "raise", SkipStats())]
    assert pieces == many


def test_text_per_line_and_per_file(tmp_path):
    (tmp_path / "lines.txt").write_text("alpha beta\n\ngamma δ\n", encoding="utf-8")
    (tmp_path / "whole.txt.gz").write_bytes(gzip.compress(b"one\ndocument\n"))
    docs, stats = _read([tmp_path / "lines.txt"])
    assert docs == ["alpha beta", "gamma δ"]
    assert stats.skipped == {"empty_text": 1}  # the blank line is counted, not silently dropped
    assert _read([tmp_path / "whole.txt.gz"], fmt="text_file")[0] == ["one\ndocument\n"]


def test_byte_range_units_read_every_line_once(tmp_path):
    lines = [f"document number {i} " + "x" * (i % 13) for i in range(300)]
    path = tmp_path / "big.txt"
    path.write_text("\n".join(lines) + "\n")
    units = plan_units("s", [str(path)], "auto", "text", chunk_bytes=97)
    assert len(units) > 10
    assert [d for u in units for d in read_documents(u, "raise", SkipStats())] == lines


def test_globs_and_comma_lists(tmp_path):
    for i in range(3):
        (tmp_path / f"part{i}.jsonl").write_bytes(_jsonl([f"doc {i}"]))
    (tmp_path / "other.txt").write_text("t\n")
    assert len(expand_paths(str(tmp_path / "part*.jsonl"))) == 3
    assert len(expand_paths(f"{tmp_path}/part0.jsonl,{tmp_path}/*.txt")) == 2
    with pytest.raises(ConfigError, match="matches at least one file"):
        expand_paths(str(tmp_path / "nothing*.jsonl"), "data.sources[0].path")


def test_unknown_extension_is_a_clear_error(tmp_path):
    (tmp_path / "a.csv").write_text("x\n")
    with pytest.raises(ConfigError, match="known extension"):
        _read([tmp_path / "a.csv"])


BAD_JSONL = (b'{"text": "good one"}\n{"text": broken\n{"title": "no text"}\n{"text": "bad \xff byte"}\n'
             b'{"text": 7}\n{"text": "good two"}\n')


@pytest.mark.parametrize(("line", "reason", "message"), [
    (2, "malformed_json", "malformed json"),
    (3, "missing_field", "missing field"),
    (4, "invalid_utf8", "invalid utf8"),
])
def test_bad_jsonl_raises_naming_file_and_line(tmp_path, line, reason, message):
    lines = BAD_JSONL.splitlines(keepends=True)
    path = tmp_path / "bad.jsonl"
    path.write_bytes(lines[0] + lines[line - 1])  # the bad record on line 2
    with pytest.raises(DataError, match=message) as err:
        _read([path])
    assert err.value.where == f"{path}:2" and err.value.reason == reason
    assert f"{path}:2" in str(err.value) and "on_error=skip" in str(err.value)


def test_bad_jsonl_skipped_and_counted(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(BAD_JSONL)
    docs, stats = _read([path], on_error="skip")
    assert docs == ["good one", "good two"]
    assert stats.documents == 2
    assert stats.skipped == {"malformed_json": 1, "missing_field": 2, "invalid_utf8": 1}
    assert stats.examples["missing_field"] == [f"{path}:3", f"{path}:5"]
    assert "skipped 4" in stats.summary() and f"{path}:2" in stats.summary()


def test_line_numbers_are_file_lines_in_later_byte_ranges(tmp_path):
    path = tmp_path / "big.jsonl"
    good = _jsonl([f"document {i}" for i in range(200)])
    path.write_bytes(good + b"{oops\n" + good)
    with pytest.raises(DataError) as err:
        for unit in plan_units("s", [str(path)], "auto", "text", chunk_bytes=500):
            list(read_documents(unit, "raise", SkipStats()))
    assert err.value.where == f"{path}:201"


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.txt", "empty.jsonl.zst"])
def test_empty_file(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(zstandard.ZstdCompressor().compress(b"") if name.endswith(".zst") else b"")
    with pytest.raises(DataError, match="empty file") as err:
        _read([path])
    assert err.value.where == str(path)
    docs, stats = _read([path], on_error="skip")
    assert docs == [] and stats.skipped == {"empty_file": 1}


def test_parquet_bad_input(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": ["ok", None, "", "fine"]}), path)
    with pytest.raises(DataError, match="row 2"):
        _read([path])
    docs, stats = _read([path], on_error="skip")
    assert docs == ["ok", "fine"] and stats.skipped == {"missing_field": 1, "empty_text": 1}
    with pytest.raises(DataError, match="column 'body' not in columns"):
        _read([path], field="body")
    binary = tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": pa.array([b"ok", b"\xff\xfe"], type=pa.binary())}), binary)
    with pytest.raises(DataError, match=f"{binary}: row 2: invalid utf8"):
        _read([binary])
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": pa.array([], type=pa.string())}), empty)
    assert _read([empty], on_error="skip")[1].skipped == {"empty_file": 1}


def test_data_error_survives_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(DataError("f.jsonl:3", "malformed_json", "oops")))
    assert err.where == "f.jsonl:3" and "f.jsonl:3" in str(err)
