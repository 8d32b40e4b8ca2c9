"""Synthetic corpus with QA training text (qa_fraction): held-out phrasings stay unseen, splits are right."""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

import pytest

from memlm.data.synthetic import ATTRIBUTES, generate, main, write_corpus
from memlm.data.synthetic_templates import (
    BIO_TEMPLATES,
    QUESTION_TEMPLATES,
    TRAIN_QUESTION_TEMPLATES,
)
from memlm.errors import ConfigError
from memlm.evals.prompts import TARGET_DELIMITER, qa_text


def _trigrams(template: str) -> set[str]:
    grams = set()
    for fragment in re.split(r"\{\w+\}", template):
        words = fragment.lower().translate(str.maketrans("", "", string.punctuation)).split()
        grams |= {" ".join(words[i:i + 3]) for i in range(len(words) - 2)}
    return grams


def test_training_question_templates_are_disjoint_from_evaluation_ones():
    assert set(TRAIN_QUESTION_TEMPLATES) == set(ATTRIBUTES)
    for attribute in ATTRIBUTES:
        train = set().union(*map(_trigrams, TRAIN_QUESTION_TEMPLATES[attribute]))
        for other in ATTRIBUTES:  # no evaluation template of any attribute shares a trigram
            for template in QUESTION_TEMPLATES[other]:
                assert not _trigrams(template) & train, (template, _trigrams(template) & train)
        assert not set(TRAIN_QUESTION_TEMPLATES[attribute]) & set(QUESTION_TEMPLATES[attribute])
        assert not set(TRAIN_QUESTION_TEMPLATES[attribute]) & set(BIO_TEMPLATES[attribute])


def test_qa_fraction_adds_qa_documents_for_the_first_people_only():
    people, bios_only, qa0 = generate(40, 2, seed=5)
    people_q, docs, qa = generate(40, 2, seed=5, qa_fraction=0.25)
    assert people_q == people and qa == qa0  # people and evaluation questions do not depend on it
    qa_docs = [d for d in docs if d.startswith("Q: ")]
    assert sorted(set(docs) - set(qa_docs)) == sorted(bios_only)  # the same biographies
    assert len(qa_docs) == 10
    for person in people[:10]:
        (doc,) = [d for d in qa_docs if person.name in d]
        pairs = doc.split("\n\n")
        assert len(pairs) == len(ATTRIBUTES)
        for attribute in ATTRIBUTES:
            assert any(p.endswith("\nA: " + getattr(person, attribute)) for p in pairs), attribute
    assert not any(p.name in d for p in people[10:] for d in qa_docs)


def test_qa_documents_use_the_evaluation_prompt_layout_but_never_its_phrasings():
    _, docs, qa = generate(30, 2, seed=1, qa_fraction=1.0)
    text = "\n".join(docs).lower()
    for item in qa:
        assert item["question"].lower() not in text
    eval_grams = set().union(*(_trigrams(t) for ts in QUESTION_TEMPLATES.values() for t in ts))
    words = text.translate(str.maketrans("", "", string.punctuation)).split()
    assert not eval_grams & {" ".join(words[i:i + 3]) for i in range(len(words) - 2)}
    pair = next(d for d in docs if d.startswith("Q: ")).split("\n\n")[0]
    question, answer = pair[len("Q: "):].split("\nA: ")
    assert pair == qa_text(question) + TARGET_DELIMITER + answer  # what evaluation prompts look like


def test_seen_and_unseen_files_split_the_questions(tmp_path):
    paths = write_corpus(str(tmp_path), 20, 1, seed=2, qa_fraction=0.5)
    rows = {k: [json.loads(line) for line in open(paths[k])] for k in ("qa", "qa_seen", "qa_unseen")}
    assert len(rows["qa_seen"]) == len(rows["qa_unseen"]) == 10 * len(ATTRIBUTES)
    assert rows["qa_seen"] + rows["qa_unseen"] == rows["qa"]
    train = open(paths["train"]).read()
    people = [json.loads(line)["name"] for line in open(paths["people"])]
    assert all("Q: " in train and name in train for name in people)
    seen_names = {n for n in people if any(n in r["question"] for r in rows["qa_seen"])}
    assert seen_names == set(people[:10])


def test_bad_qa_fraction(capsys):
    with pytest.raises(ConfigError, match=r"qa_fraction.*\[0, 1\]"):
        generate(10, 1, qa_fraction=1.5)
    assert main(["--people", "3", "--out", "/nonexistent-unused", "--qa-fraction", "-0.1"]) == 2  # one error line
    assert capsys.readouterr().err.startswith("error: invalid config value qa_fraction=-0.1")


def test_seen_and_unseen_eval_tasks(tmp_path):
    from memlm.config.eval import EvalConfig
    from memlm.data.config import DataConfig, SyntheticConfig
    from memlm.evals.tasks import load_task

    cfg = EvalConfig(tasks=["synthetic_qa_seen"], num_fewshot=2)
    data = DataConfig(kind="synthetic", vocab_size=400, cache_dir=str(tmp_path),
                      synthetic=SyntheticConfig(people=12, docs_per_person=1, qa_fraction=0.25))
    seen = load_task("synthetic_qa_seen", cfg, data)
    unseen = load_task("synthetic_qa_unseen", cfg, data)
    assert len(seen.examples) + 2 == 3 * len(ATTRIBUTES) and len(unseen.examples) + 2 == 9 * len(ATTRIBUTES)
    names = [json.loads(line)["name"] for line in open(next(tmp_path.glob("synthetic-*")) / "people.jsonl")]
    assert all(any(n in ex["question"] for n in names[:3]) for ex in seen.examples + seen.shots[""])
    data.synthetic.qa_fraction = 0.0
    with pytest.raises(ConfigError, match="qa_fraction.*strictly between 0 and 1"):
        load_task("synthetic_qa_unseen", cfg, data)


def test_qa_docs_per_person_asks_each_fact_in_distinct_training_phrasings():
    people, docs, _ = generate(12, 1, seed=4, qa_fraction=0.5, qa_docs_per_person=3)
    qa_docs = [d for d in docs if d.startswith("Q: ")]
    assert len(qa_docs) == 6 * 3
    for person in people[:6]:
        mine = [d for d in qa_docs if person.name in d]
        assert len(mine) == 3
        for attribute in ATTRIBUTES:
            answer = "\nA: " + getattr(person, attribute)
            questions = [p.split("\nA: ")[0] for d in mine for p in d.split("\n\n") if p.endswith(answer)]
            templates = {t.format(n=person.name) for t in TRAIN_QUESTION_TEMPLATES[attribute]}
            # One pair per document (values of other attributes never equal this one's text).
            assert len(questions) == 3 and len(set(questions)) == 3, (attribute, questions)
            assert {q[len("Q: "):] for q in questions} <= templates


def test_qa_trained_file_asks_in_the_first_training_phrasing(tmp_path):
    paths = write_corpus(str(tmp_path), 10, 1, seed=6, qa_fraction=0.4, qa_docs_per_person=2)
    trained = [json.loads(line) for line in open(paths["qa_trained"])]
    people = [json.loads(line) for line in open(paths["people"])]
    assert len(trained) == 4 * len(ATTRIBUTES)
    train = open(paths["train"]).read()
    eval_questions = {json.loads(line)["question"] for line in open(paths["qa"])}
    for row in trained:
        assert any(p["name"] in row["question"] for p in people[:4])  # a seen person
        assert json.dumps(f"Q: {row['question']}\nA: {row['answer'][0]}")[1:-1] in train  # a trained pair
        assert row["question"] not in eval_questions
    assert {r["question"].count(p["name"]) for r in trained for p in people[4:]} == {0}


def test_every_question_names_its_template(tmp_path):
    from memlm.data.synthetic_templates import QUESTION_TEMPLATES, TRAIN_QUESTION_TEMPLATES

    paths = write_corpus(str(tmp_path), 30, 1, seed=2, qa_fraction=0.5, qa_docs_per_person=2)
    people = {p["name"]: p for p in map(json.loads, open(paths["people"]))}
    for split, templates, mark in (("qa", QUESTION_TEMPLATES, "q"), ("qa_trained", TRAIN_QUESTION_TEMPLATES, "t")):
        rows = [json.loads(line) for line in open(paths[split])]
        for row in rows:
            attribute, _, index = row["phrasing"].partition("/")
            assert index[0] == mark
            name = next(n for n in people if n in row["question"])
            assert templates[attribute][int(index[1:])].format(n=name) == row["question"]
        if split == "qa":  # 30 people x 7 attributes: more than one phrasing of each attribute drawn
            assert len({r["phrasing"] for r in rows}) > 2 * len(ATTRIBUTES)


def test_bad_qa_docs_per_person():
    from memlm.data.config import DataConfig, SyntheticConfig
    from memlm.data.synthetic import MAX_QA_DOCS

    with pytest.raises(ConfigError, match=rf"qa_docs_per_person.*\[1, {MAX_QA_DOCS}\]"):
        generate(10, 1, qa_fraction=0.5, qa_docs_per_person=MAX_QA_DOCS + 1)
    cfg = DataConfig(kind="synthetic", vocab_size=400, synthetic=SyntheticConfig(qa_fraction=0.5, qa_docs_per_person=0))
    with pytest.raises(ConfigError, match=r"data\.synthetic\.qa_docs_per_person.*0"):
        cfg.validate("data")


def test_trained_eval_task(tmp_path):
    from memlm.config.eval import EvalConfig
    from memlm.data.config import DataConfig, SyntheticConfig
    from memlm.evals.tasks import load_task

    cfg = EvalConfig(tasks=["synthetic_qa_trained"], num_fewshot=0)
    data = DataConfig(kind="synthetic", vocab_size=400, cache_dir=str(tmp_path),
                      synthetic=SyntheticConfig(people=12, docs_per_person=1, qa_fraction=1.0, qa_docs_per_person=2))
    trained = load_task("synthetic_qa_trained", cfg, data)
    assert len(trained.examples) == 12 * len(ATTRIBUTES)
    assert next(tmp_path.glob("synthetic-*")).name.startswith("synthetic-p12-d1-s0-q1x2-g")
    data.synthetic.qa_fraction = 0.0
    with pytest.raises(ConfigError, match="qa_fraction.*> 0"):
        load_task("synthetic_qa_trained", cfg, data)


def test_shards_prepared_from_a_synthetic_corpus_are_asked_about_its_own_people(tmp_path):
    """kind=shards data made from a synthetic corpus (as the demo does): the
    synthetic tasks read that corpus' question files, found through the
    shards' manifest, not questions about the default corpus' people."""
    from memlm.config.eval import EvalConfig
    from memlm.data.config import DataConfig, SourceConfig, SyntheticConfig
    from memlm.data.corpus import materialize_synthetic
    from memlm.data.prepare import prepare
    from memlm.evals.tasks import load_task, synthetic_folder_of_shards

    syn = DataConfig(kind="synthetic", vocab_size=400, cache_dir=str(tmp_path / "c"),
                     synthetic=SyntheticConfig(people=12, docs_per_person=1, qa_fraction=0.5))
    corpus = materialize_synthetic(syn)
    prepare([SourceConfig(name="bios", path=corpus["train"])], corpus["tokenizer"], str(tmp_path / "s"), workers=1)
    shards = DataConfig(kind="shards", shards_dir=str(tmp_path / "s"), tokenizer=corpus["tokenizer"])
    folder = synthetic_folder_of_shards(shards)
    assert folder is not None and folder.samefile(Path(corpus["train"]).parent)
    cfg = EvalConfig(tasks=["synthetic_qa_trained"], num_fewshot=0)
    names = [json.loads(line)["name"] for line in open(folder / "people.jsonl")]
    for task, people in (("synthetic_qa_trained", names[:6]), ("synthetic_qa_seen", names[:6]),
                         ("synthetic_qa", names)):
        examples = load_task(task, cfg, shards).examples
        assert examples and all(any(n in ex["question"] for n in people) for ex in examples), task
    # Shards of another corpus: no synthetic folder, and synthetic_qa is refused (not asked
    # about some other corpus' people).
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "plain text"}\n' * 4)
    prepare([SourceConfig(name="web", path=str(other))], corpus["tokenizer"], str(tmp_path / "s2"), workers=1)
    assert synthetic_folder_of_shards(DataConfig(kind="shards", shards_dir=str(tmp_path / "s2"))) is None
    with pytest.raises(ConfigError, match="manifest.json names no synthetic corpus"):
        load_task("synthetic_qa", cfg, DataConfig(kind="shards", shards_dir=str(tmp_path / "s2")))
    # A corpus without QA text: the task that needs it says so.
    bare = DataConfig(kind="synthetic", vocab_size=400, cache_dir=str(tmp_path / "c2"),
                      synthetic=SyntheticConfig(people=12, docs_per_person=1))
    bare_corpus = materialize_synthetic(bare)
    prepare([SourceConfig(name="bios", path=bare_corpus["train"])], bare_corpus["tokenizer"], str(tmp_path / "s3"),
            workers=1)
    with pytest.raises(ConfigError, match="synthetic_qa_trained.*qa_trained.jsonl is missing or empty"):
        load_task("synthetic_qa_trained", cfg, DataConfig(kind="shards", shards_dir=str(tmp_path / "s3")))
