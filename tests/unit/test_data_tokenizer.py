"""Tokenizer: training, byte-fallback Unicode round trip, special ids, hash, determinism, CLI."""

from __future__ import annotations

import json
import random

import pytest

from memlm.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    Tokenizer,
    main,
    sample_lines,
    train_tokenizer,
)
from memlm.errors import ConfigError

WORDS = ["the", "model", "remembers", "facts", "about", "people", "and", "places", "memory", "layer"]


def _corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return train_tokenizer(_corpus(), str(tmp_path_factory.mktemp("tok") / "t.model"), vocab_size=300)


UNICODE = [
    "Crème brûlée, naïve façade, Ærøskøbing, Łódź",
    "東京は日本の首都です。北京欢迎你",
    "emoji 🚀🧠👩🏽‍🔬 and flags 🇩🇪",
    "  leading spaces,\ttabs\nand newlines\r\n",
    "mixed: the model 記憶 remembers ∑ facts",
]


def test_unicode_round_trip_via_byte_fallback(tok):
    for text in UNICODE:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    # CJK / emoji were never seen in training: they can only come back through byte pieces.
    ids = tok.encode("🚀")
    assert len(ids) == 4 and all(tok.sp.is_byte(i) for i in ids)


def test_batch_encode_decode(tok):
    batch = tok.encode_batch(UNICODE)
    assert batch == [tok.encode(t) for t in UNICODE]
    assert tok.decode_batch(batch) == UNICODE


def test_special_ids_and_vocab(tok):
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (BOS_ID, EOS_ID, PAD_ID) == (1, 2, 3)
    assert tok.vocab_size == 300
    assert EOS_ID not in tok.encode("the model remembers")


def test_training_is_deterministic_and_hash_identifies_the_model(tmp_path, tok):
    a = train_tokenizer(_corpus(), str(tmp_path / "a.model"), vocab_size=300)
    b = train_tokenizer(_corpus(), str(tmp_path / "b.model"), vocab_size=300)
    c = train_tokenizer(_corpus(seed=1) + ["different"], str(tmp_path / "c.model"), vocab_size=300)
    assert a.sha256 == b.sha256 == tok.sha256
    assert c.sha256 != a.sha256
    assert len(a.sha256) == 64


def test_sampling_large_inputs_is_seeded():
    docs = [f"line {i}" for i in range(1000)]
    first = list(sample_lines(docs, 50, shuffle=True, seed=3))
    assert first == list(sample_lines(docs, 50, shuffle=True, seed=3))
    assert first != list(sample_lines(docs, 50, shuffle=True, seed=4))
    assert len(first) == 50 and len(set(first)) == 50
    assert list(sample_lines(["a\nb", "", "c"], 0, shuffle=False, seed=0)) == ["a", "b", "c"]


def test_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="vocab_size"):
        train_tokenizer(_corpus(), str(tmp_path / "x.model"), vocab_size=100)
    with pytest.raises(ConfigError, match="existing sentencepiece"):
        Tokenizer(str(tmp_path / "missing.model"))


def test_cli_train_and_info(tmp_path, capsys):
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"body": d}) + "\n" for d in _corpus()))
    out = tmp_path / "cli.model"
    assert main(["train", "--input", str(src), "--text-field", "body", "--vocab-size", "300",
                 "--out", str(out), "--threads", "1"]) == 0
    assert "trained" in capsys.readouterr().out
    assert main(["info", str(out)]) == 0
    assert Tokenizer(str(out)).sha256 in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
