"""Preparation: shards + manifest, decode back to the input, resume, val split, tokenizer hash check."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from memlm.data.config import DataConfig, SourceConfig
from memlm.data.corpus import open_corpus
from memlm.data.encode import is_validation
from memlm.data.loader import build_loader
from memlm.data.prepare import main, prepare
from memlm.data.shards import load_split, read_manifest
from memlm.data.stats import DataError
from memlm.data.tokenizer import train_tokenizer
from memlm.errors import ConfigError


def _docs(prefix: str, n: int) -> list[str]:
    return [f"{prefix} document {i}: " + "word " * (i % 17) for i in range(n)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("prep")
    docs = {"a": _docs("alpha", 300), "b": _docs("beta", 120)}
    for name, texts in docs.items():
        with open(root / f"{name}.jsonl", "w") as fh:
            fh.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    tok = train_tokenizer(docs["a"] + docs["b"], str(root / "tok.model"), vocab_size=300)
    return root, docs, tok


def _sources(root):
    return [SourceConfig(name="a", path=str(root / "a.jsonl"), weight=3.0),
            SourceConfig(name="b", path=str(root / "b.jsonl"))]


def _decode_split(out, manifest, tok, source, split):
    texts = []
    for tokens, offsets in load_split(str(out), manifest, source, split):
        for lo, hi in zip(offsets[:-1], offsets[1:]):
            assert tokens[hi - 1] == tok.eos_id  # every document ends in EOS
            texts.append(tok.decode(tokens[lo:hi - 1]))
    return texts


def test_prepare_round_trip_and_val_split(setup, tmp_path):
    root, docs, tok = setup
    manifest = prepare(_sources(root), tok.path, str(tmp_path), workers=1, val_fraction=0.2,
                       chunk_bytes=2000, show_progress=False)
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["sha256"] == tok.sha256
    assert read_manifest(str(tmp_path))["sources"].keys() == {"a", "b"}
    for name, texts in docs.items():
        train = _decode_split(tmp_path, manifest, tok, name, "train")
        val = _decode_split(tmp_path, manifest, tok, name, "val")
        assert train == [t for t in texts if not is_validation(t, 0.2)]  # file order, nothing lost
        assert val == [t for t in texts if is_validation(t, 0.2)]
        assert 0.1 < len(val) / len(texts) < 0.3
    assert len(manifest["sources"]["a"]["shards"]["train"]) > 1  # chunked into several units


def test_parallel_equals_serial_and_resume_skips_finished(setup, tmp_path):
    root, _, tok = setup
    serial = prepare(_sources(root), tok.path, str(tmp_path / "s"), workers=1, chunk_bytes=2000, show_progress=False)
    par = prepare(_sources(root), tok.path, str(tmp_path / "p"), workers=2, chunk_bytes=2000, show_progress=False)
    assert par["_run"]["tokenized_units"] == serial["_run"]["tokenized_units"] > 2
    for name in ("a", "b"):
        for (t1, o1), (t2, o2) in zip(load_split(str(tmp_path / "s"), serial, name, "train"),
                                      load_split(str(tmp_path / "p"), par, name, "train")):
            assert np.array_equal(t1, t2) and np.array_equal(o1, o2)
    # Simulate a crash that lost one unit: only that unit is redone.
    os.remove(tmp_path / "s" / "a" / "unit-00001.json")
    again = prepare(_sources(root), tok.path, str(tmp_path / "s"), workers=1, chunk_bytes=2000, show_progress=False)
    assert again["_run"]["tokenized_units"] == 1
    assert again["_run"]["reused_units"] == serial["_run"]["tokenized_units"] - 1
    assert again["sources"] == serial["sources"]


def test_shards_of_another_tokenizer_fail_to_load(setup, tmp_path):
    root, docs, tok = setup
    prepare(_sources(root), tok.path, str(tmp_path / "shards"), show_progress=False)
    other = train_tokenizer(docs["a"][:100], str(tmp_path / "other.model"), vocab_size=290)
    cfg = DataConfig(kind="shards", shards_dir=str(tmp_path / "shards"), tokenizer=other.path)
    with pytest.raises(ConfigError, match="tokenizer hash mismatch") as err:
        build_loader(cfg)
    assert tok.sha256[:16] in str(err.value) and other.sha256[:16] in str(err.value)
    cfg.tokenizer = tok.path
    assert build_loader(cfg).vocab_size == tok.vocab_size
    cfg.tokenizer = ""  # the one recorded in the manifest
    assert open_corpus(cfg).tokenizer.sha256 == tok.sha256


def test_missing_manifest_and_unknown_source(setup, tmp_path):
    root, _, tok = setup
    with pytest.raises(ConfigError, match="run `python -m memlm.data.prepare"):
        build_loader(DataConfig(kind="shards", shards_dir=str(tmp_path)))
    prepare(_sources(root)[:1], tok.path, str(tmp_path), show_progress=False)
    cfg = DataConfig(kind="shards", shards_dir=str(tmp_path), sources=[SourceConfig(name="zzz")])
    with pytest.raises(ConfigError, match="a source prepared in"):
        build_loader(cfg)


def test_bad_records_raise_or_are_counted_in_the_manifest(setup, tmp_path):
    _, _, tok = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n{"other": 1}\n')
    src = [SourceConfig(name="bad", path=str(bad))]
    with pytest.raises(DataError, match=f"{bad}:2"):
        prepare(src, tok.path, str(tmp_path / "r"), show_progress=False)
    manifest = prepare(src, tok.path, str(tmp_path / "k"), on_error="skip", show_progress=False)
    stats = manifest["sources"]["bad"]["stats"]
    assert stats["documents"] == 1 and stats["skipped"] == {"malformed_json": 1, "missing_field": 1}


def test_empty_source_list_is_rejected(setup, tmp_path):
    with pytest.raises(ConfigError, match="non-empty list"):
        prepare([], setup[2].path, str(tmp_path), show_progress=False)


def test_cli(setup, tmp_path, capsys):
    root, _, tok = setup
    out = tmp_path / "cli"
    args = ["--source", f"a={root}/a.jsonl", "--source", f"b={root}/b.*", "--tokenizer", tok.path,
            "--out", str(out), "--workers", "1", "--val-fraction", "0.1"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "prepared" in text and "a: train" in text and "nothing skipped" in text
    assert main(args) == 0
    assert "0 units tokenized" in capsys.readouterr().out  # the rerun resumes: nothing left to do
    preset = tmp_path / "preset.yaml"
    preset.write_text(f"sources:\n  - name: a\n    path: {root}/a.jsonl\ntokenizer: {tok.path}\n"
                      f"shards_dir: {tmp_path / 'from_preset'}\n")
    assert main(["--config", str(preset), "--workers", "1"]) == 0
    assert read_manifest(str(tmp_path / "from_preset"))["sources"].keys() == {"a"}
