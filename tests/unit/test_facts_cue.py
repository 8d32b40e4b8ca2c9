"""A facts file (`bits:<folder>`, `facts_bits`) is scored as prompt + " " + answer,
with the question as the verbatim prompt: a question without the answer cue
(`\\nA:`) would score about 0 bits on a model that stored the facts, so such a
file is refused, naming the file, how many questions lack the cue, the first
one and what is valid. The cue is the one the corpora and the QA prompts use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memlm.config.eval import EvalConfig
from memlm.evals.formats import TaskDataError
from memlm.evals.tasks import load_task

CUED = [{"question": f"Q: What is the metal of Kavoru Tesilan{i}?\nA:", "answer": "rimo", "values": 256}
        for i in range(4)]


def _write(folder: Path, records: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "facts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _load(tmp_path: Path):
    return load_task("bits:facts", EvalConfig(tasks=["bits:facts"], data_dir=str(tmp_path)))


def test_facts_in_the_corpus_layout_are_loaded(tmp_path):
    _write(tmp_path / "facts", CUED)
    task = _load(tmp_path)
    assert [ex["question"] for ex in task.examples] == [r["question"] for r in CUED]


def test_a_facts_file_without_the_answer_cue_is_refused_naming_file_count_example_and_format(tmp_path):
    # The question as a person would write it: the model read "Q: ...?\nA: rimo" in training.
    bare = [{**r, "question": r["question"].removeprefix("Q: ").removesuffix("\nA:")} for r in CUED]
    path = _write(tmp_path / "facts", bare)
    with pytest.raises(TaskDataError) as err:
        _load(tmp_path)
    message = str(err.value)
    assert f"{path}: 4 of 4 questions" in message
    assert f"{path}:1" in message and "'What is the metal of Kavoru Tesilan0?'" in message
    assert r"'\nA:'" in message and "verbatim prompt" in message


def test_a_partly_cued_facts_file_is_refused_with_the_count(tmp_path):
    # A trailing space after the cue is not the cue: the answer would be scored after two spaces.
    mixed = [CUED[0], {**CUED[1], "question": CUED[1]["question"] + " "}, CUED[2], {**CUED[3], "question": "Q: x?"}]
    path = _write(tmp_path / "facts", mixed)
    with pytest.raises(TaskDataError, match=rf"{path}: 2 of 4 questions .*first: {path}:2"):
        _load(tmp_path)


@pytest.mark.parametrize("answer", [" rimo", "rimo\n", ""])
def test_an_answer_with_surrounding_spaces_or_empty_is_refused_naming_its_line(tmp_path, answer):
    path = _write(tmp_path / "facts", [CUED[0], {**CUED[1], "answer": answer}])
    with pytest.raises(TaskDataError, match=rf"{path}:2: .*'answer'"):
        _load(tmp_path)


def test_the_cue_is_the_one_the_facts_corpus_and_the_qa_prompts_use():
    from memlm.config.eval_tasks import ANSWER_CUE
    from memlm.data import facts
    from memlm.evals.prompts import qa_prompt

    assert ANSWER_CUE == "\nA:"
    assert facts.question("Kavoru Tesilan", "metal").endswith(ANSWER_CUE)
    assert qa_prompt([], "who wrote the iliad").endswith(ANSWER_CUE)
    assert facts.document("E", "metal", "rimo") == facts.question("E", "metal") + " rimo"
