"""Synthetic factual corpus: deterministic, unique people, QA phrasings unseen in training, answers stated."""

from __future__ import annotations

import hashlib
import json
import re
import string

import pytest

from memlm.data import synthetic_vocab as vocab
from memlm.data.synthetic import ATTRIBUTES, generate, main, make_people, max_people, write_corpus
from memlm.data.synthetic_templates import BIO_TEMPLATES, QUESTION_TEMPLATES
from memlm.errors import ConfigError


@pytest.fixture(scope="module")
def small():
    return generate(people=150, docs_per_person=3, seed=7)


def _digest(folder) -> str:
    return hashlib.sha256(
        b"".join((folder / f).read_bytes() for f in ("train.jsonl", "qa.jsonl", "people.jsonl"))).hexdigest()


def test_deterministic_for_a_seed(tmp_path):
    a = write_corpus(str(tmp_path / "a"), 40, 2, seed=3)
    write_corpus(str(tmp_path / "b"), 40, 2, seed=3)
    write_corpus(str(tmp_path / "c"), 40, 2, seed=4)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b") != _digest(tmp_path / "c")
    rows = [json.loads(line) for line in open(a["qa"])]
    assert len(rows) == 40 * len(ATTRIBUTES)
    # NQ-open records, plus the name of the question template
    assert all(set(r) == {"question", "answer", "phrasing"} and isinstance(r["answer"], list) for r in rows)


def test_unique_people_and_large_value_sets(small):
    people, docs, _ = small
    assert len({p.name for p in people}) == len(people) == 150
    assert len(docs) == 450
    assert max_people() > 20_000
    assert min(len(vocab.cities()), len(vocab.companies()), len(vocab.universities())) >= 1000
    assert min(len(vocab.OCCUPATIONS), len(vocab.MAJORS), len(vocab.FOODS)) >= 50
    # with 150 people the values spread out: no attribute collapses onto a handful of values
    assert all(len({getattr(p, a) for p in people}) > 30 for a in ATTRIBUTES)


def test_question_phrasings_never_appear_in_training_text(small):
    _, docs, qa = small
    text = "\n".join(docs).lower()
    assert "?" not in text
    for item in qa:
        assert item["question"].lower() not in text
    # Stronger: no word trigram of a question template's fixed text occurs in any biography.
    for templates in QUESTION_TEMPLATES.values():
        for template in templates:
            for fragment in re.split(r"\{\w+\}", template):
                words = fragment.lower().translate(str.maketrans("", "", string.punctuation)).split()
                for i in range(len(words) - 2):
                    assert " ".join(words[i:i + 3]) not in text, (template, words[i:i + 3])


def test_template_sets_are_disjoint():
    bios = {t for ts in BIO_TEMPLATES.values() for t in ts}
    questions = {t for ts in QUESTION_TEMPLATES.values() for t in ts}
    assert not bios & questions
    assert set(BIO_TEMPLATES) == set(QUESTION_TEMPLATES) == set(ATTRIBUTES)
    assert all(len(ts) >= 5 for ts in BIO_TEMPLATES.values())
    # Held-out exact match averages over the phrasings: with 3 per attribute a tiny model
    # understanding one more or one fewer of the 21 moved it by ~5 points (docs/results.md).
    assert all(len(ts) >= 10 for ts in QUESTION_TEMPLATES.values())
    assert all(len(set(ts)) == len(ts) for ts in QUESTION_TEMPLATES.values())


def test_every_answer_is_stated_in_the_training_text(small):
    people, docs, qa = small
    by_name = {p.name: [d for d in docs if p.name in d] for p in people}
    for person in people:
        assert len(by_name[person.name]) == 3  # each paraphrase names the person
        for attribute in ATTRIBUTES:
            value = getattr(person, attribute)
            assert all(value in doc for doc in by_name[person.name]), (person.name, attribute)
    for item, (person, attribute) in zip(qa, [(p, a) for p in people for a in ATTRIBUTES]):
        assert person.name in item["question"]
        assert item["answer"][0] == getattr(person, attribute)
        assert any(item["answer"][0] in doc for doc in by_name[person.name])


def test_paraphrases_differ(small):
    people, docs, _ = small
    mine = [d for d in docs if people[0].name in d]
    assert len(set(mine)) == len(mine)


def test_bad_arguments():
    with pytest.raises(ConfigError, match="people"):
        make_people(max_people() + 1, 0)
    with pytest.raises(ConfigError, match="docs_per_person"):
        generate(3, 0)


def test_cli(tmp_path, capsys):
    assert main(["--people", "12", "--out", str(tmp_path), "--docs-per-person", "2"]) == 0
    assert "24 biographies of 12 people" in capsys.readouterr().out
    assert sum(1 for _ in open(tmp_path / "train.jsonl")) == 24
