"""The continual-learning study's corpora (memlm.data.continual)."""

from __future__ import annotations

import json

import pytest

from memlm.data import continual, facts
from memlm.data.tokenizer import Tokenizer
from memlm.errors import ConfigError


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(out, **kw):
    args = dict(entities=12, new_entities=6, rounds=3, people=10, docs_per_person=2, qa_fraction=0.5, vocab_size=400)
    return continual.write_study(str(out), **{**args, **kw})


def test_old_and_new_facts_share_values_but_no_entity(tmp_path):
    manifest = _write(tmp_path)
    a, b = _jsonl(tmp_path / "facts_a" / "facts.jsonl"), _jsonl(tmp_path / "facts_b" / "facts.jsonl")
    assert a + b == facts.generate(18, 4, 256, 0)  # one draw: the same candidate values per attribute
    assert len(a) == 12 * 4 and len(b) == 6 * 4
    assert not {f["entity"] for f in a} & {f["entity"] for f in b}
    assert manifest["bits_a"] == 48 * 8 and manifest["bits_b"] == 24 * 8
    rounds = [_jsonl(tmp_path / f"facts_b{r}" / "facts.jsonl") for r in (1, 2, 3)]
    assert sum(rounds, []) == b and [len({f["entity"] for f in r}) for r in rounds] == [2, 2, 2]
    train_b = {d["text"] for d in _jsonl(tmp_path / "facts_b" / "train.jsonl")}
    assert train_b == {facts.document(f["entity"], f["attribute"], f["answer"]) for f in b}


def test_general_text_holds_out_a_paraphrase_and_question_phrasings(tmp_path):
    _write(tmp_path)
    train = [d["text"] for d in _jsonl(tmp_path / "bio" / "train.jsonl")]
    heldout = [d["text"] for d in _jsonl(tmp_path / "bio_heldout" / "test.jsonl")]
    questions = _jsonl(tmp_path / "bio_qa" / "test.jsonl")
    assert len(heldout) == 10 and not set(heldout) & set(train)
    assert len(questions) == 5 * 7  # the 5 people with QA text, every attribute
    assert not any(q["question"] in t for q in questions for t in train)
    tok = Tokenizer(str(tmp_path / "tokenizer.model"))
    assert tok.decode(tok.encode(heldout[0])) == heldout[0]


def test_the_same_arguments_give_the_same_bytes(tmp_path):
    _write(tmp_path / "x")
    _write(tmp_path / "y")
    names = sorted(p.relative_to(tmp_path / "x") for p in (tmp_path / "x").rglob("*") if p.is_file())
    # facts parts, their paraphrases (facts B and each of 3 rounds), biography parts, tokenizer and manifest
    assert len(names) == (2 + 3) * 2 + 4 + 3 + 2 and all(
        (tmp_path / "x" / n).read_bytes() == (tmp_path / "y" / n).read_bytes() for n in names)


@pytest.mark.parametrize("key, kw", [("rounds", {"rounds": 7}), ("rounds", {"rounds": 0}),
                                     ("qa_fraction", {"qa_fraction": 0.0})])
def test_bad_arguments_name_the_value_and_what_is_valid(tmp_path, key, kw):
    with pytest.raises(ConfigError, match=key):
        _write(tmp_path, **kw)


def test_read_as_document_rows_each_paraphrase_batch_is_one_fact(tmp_path):
    """facts_b_para with data.rows=documents, file order, micro_batch 8: each batch is the 8 phrasings of
    one fact of facts B, and the batches cover every fact once an epoch."""
    from memlm.config.run import compose
    from memlm.data.loader import build_loader

    _write(tmp_path)
    path = tmp_path / continual.paraphrase_folder("facts_b") / "train.jsonl"
    rows = _jsonl(path)
    b = _jsonl(tmp_path / "facts_b" / "facts.jsonl")
    assert len(rows) == len(facts.PHRASINGS) * len(b)
    cfg = compose(["data.kind=raw", f"data.sources=[{{name: para, path: {path}}}]",
                   f"data.tokenizer={tmp_path / 'tokenizer.model'}", "data.rows=documents", "data.shuffle=false",
                   "data.micro_batch=8", "data.seq_len=48", "data.prefetch=0"])
    loader = build_loader(cfg.data)
    tok = Tokenizer(str(tmp_path / "tokenizer.model"))
    seen = []
    for _ in range(len(b)):
        inputs, _ = next(loader)
        texts = [tok.decode([t for t in row.tolist() if t not in (0, tok.eos_id)]) for row in inputs]
        fact = next(f for f in b if texts[0] == facts.document(f["entity"], f["attribute"], f["answer"]))
        assert texts == facts.paraphrases(fact["entity"], fact["attribute"], fact["answer"])
        seen.append(fact["question"])
    assert sorted(seen) == sorted(f["question"] for f in b)


def test_paraphrases_are_added_to_a_folder_written_without_them(tmp_path):
    _write(tmp_path)
    for part in ("facts_b", "facts_b2"):
        path = tmp_path / continual.paraphrase_folder(part) / "train.jsonl"
        before = path.read_bytes()
        path.unlink()
        assert continual.write_paraphrases(str(tmp_path), part=part) == str(path)
        assert path.read_bytes() == before
    round_two = _jsonl(tmp_path / "facts_b2" / "facts.jsonl")
    assert len(_jsonl(path)) == len(facts.PHRASINGS) * len(round_two)
