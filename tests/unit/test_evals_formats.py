"""Every task file format read from fixtures written here; few-shot pools and
limits; errors for missing or malformed files and unknown task names."""

from __future__ import annotations

import json

import pytest
from evals_fixtures import CHOICE_ROWS, MMLU_ROWS, QA_ROWS, write_jsonl, write_mmlu_csv

from memlm.config.eval import EvalConfig
from memlm.config.run import compose
from memlm.errors import ConfigError
from memlm.evals import prompts
from memlm.evals.formats import TaskDataError
from memlm.evals.tasks import load_task


def cfg(root, **kw) -> EvalConfig:
    return EvalConfig(data_dir=str(root), **kw)


def test_nq_open_pool_file_and_fallback(tmp_path):
    write_jsonl(tmp_path / "nq_open" / "NQ-open.dev.jsonl", QA_ROWS)
    task = load_task("nq_open", cfg(tmp_path, num_fewshot=2))
    # no pool file: the first 2 examples become the shots and are not evaluated
    assert [s["question"] for s in task.shots[""]] == [r["question"] for r in QA_ROWS[:2]]
    assert [e["question"] for e in task.examples] == [r["question"] for r in QA_ROWS[2:]]
    assert task.examples[0]["answers"] == ["eight", "8"]
    write_jsonl(tmp_path / "nq_open" / "train.jsonl", [{"question": "pool q", "answer": ["pool a"]}] * 3)
    task = load_task("nq_open", cfg(tmp_path, num_fewshot=2, limit=4))
    assert task.fewshot_source.endswith("train.jsonl") and len(task.shots[""]) == 2
    assert [e["question"] for e in task.examples] == [r["question"] for r in QA_ROWS[:4]]
    prompt = prompts.qa_prompt(task.shots[""], task.examples[0]["question"])
    assert prompt == "Q: pool q?\nA: pool a\n\nQ: pool q?\nA: pool a\n\nQ: who wrote the iliad?\nA:"


def test_triviaqa_release_json_and_hf_jsonl(tmp_path):
    release = {"Data": [{"Question": "Which city hosts the Louvre?",
                         "Answer": {"Aliases": ["Paris", "Paree"], "Value": "Paris", "NormalizedAliases": []}}] * 3}
    (tmp_path / "triviaqa").mkdir()
    (tmp_path / "triviaqa" / "unfiltered-web-dev.json").write_text(json.dumps(release))
    task = load_task("triviaqa", cfg(tmp_path, num_fewshot=1))
    assert task.examples[0] == {"question": "Which city hosts the Louvre?", "answers": ["Paris", "Paree"]}
    rows = [{"question": "Q1", "answer": {"aliases": ["One", "1"], "value": "one"}}] * 2
    write_jsonl(tmp_path / "triviaqa" / "test.jsonl", rows)  # preferred over the release file
    task = load_task("triviaqa", cfg(tmp_path, num_fewshot=0))
    assert task.examples[0]["answers"] == ["one", "One", "1"] and len(task.examples) == 2


def test_hotpotqa_json_list_with_string_answers(tmp_path):
    (tmp_path / "hotpotqa").mkdir()
    rows = [{"_id": str(i), "question": f"q{i}", "answer": f"a{i}", "context": []} for i in range(3)]
    (tmp_path / "hotpotqa" / "hotpot_dev_distractor_v1.json").write_text(json.dumps(rows))
    task = load_task("hotpotqa", cfg(tmp_path, num_fewshot=1))
    assert task.examples == [{"question": "q1", "answers": ["a1"]}, {"question": "q2", "answers": ["a2"]}]


def test_mmlu_csv_folders_with_dev_shots(tmp_path):
    write_mmlu_csv(tmp_path, {"high_school_math": MMLU_ROWS[:2], "biology": MMLU_ROWS[2:]}, "test")
    write_mmlu_csv(tmp_path, {"high_school_math": MMLU_ROWS[2:], "biology": MMLU_ROWS[:2]}, "dev")
    task = load_task("mmlu", cfg(tmp_path, num_fewshot=2))
    assert task.fewshot_source == "dev split" and len(task.examples) == 4
    ex = next(e for e in task.examples if e["subject"] == "high_school_math")
    assert ex == {"question": "What is 2 + 2?", "choices": ["3", "4", "5", "6"], "answer": 1,
                  "subject": "high_school_math"}
    prompt = prompts.mmlu_prompt(task.shots["high_school_math"], ex)
    assert prompt.startswith("The following are multiple choice questions (with answers) about high school math."
                             "\n\nWhat is the boiling point of water at sea level?\nA. 100 C\n")
    assert "Answer: A\n\n" in prompt and prompt.endswith("What is 2 + 2?\nA. 3\nB. 4\nC. 5\nD. 6\nAnswer:")
    with pytest.raises(TaskDataError, match="fewer than 3 shots"):
        load_task("mmlu", cfg(tmp_path, num_fewshot=3))


def test_mmlu_jsonl_without_dev_uses_first_k_per_subject(tmp_path):
    rows = [{"question": q, "choices": list(c), "answer": a, "subject": s}
            for (q, *c, a), s in zip(MMLU_ROWS * 2, ["x"] * 4 + ["y"] * 4)]
    write_jsonl(tmp_path / "mmlu" / "test.jsonl", rows)
    task = load_task("mmlu", cfg(tmp_path, num_fewshot=1))
    assert len(task.shots["x"]) == len(task.shots["y"]) == 1 and len(task.examples) == 6
    assert task.shots["x"][0]["question"] == MMLU_ROWS[0][0]
    assert [e["question"] for e in task.examples if e["subject"] == "x"] == [r[0] for r in MMLU_ROWS[1:]]


def test_choice_tasks_both_styles(tmp_path):
    write_jsonl(tmp_path / "piqa" / "validation.jsonl", CHOICE_ROWS)
    task = load_task("piqa", cfg(tmp_path, num_fewshot=0))
    assert len(task.examples) == 4 and task.examples[1]["style"] == "context"
    assert prompts.choice_prompt([], task.examples[0]) == "Question: To open a jar,\nAnswer:"
    assert prompts.choice_prompt([], task.examples[1]) == "The man puts on his shoes and"
    assert prompts.choice_continuations(task.examples[2]) == [" a feather", " a brick", " a leaf"]
    write_jsonl(tmp_path / "mine" / "test.jsonl", CHOICE_ROWS)
    assert load_task("choice:mine", cfg(tmp_path, num_fewshot=1)).shots[""][0]["choices"][0] == "twist the lid"


def test_ppl_jsonl_and_plain_text(tmp_path):
    write_jsonl(tmp_path / "ppl" / "test.jsonl", [{"text": "one doc"}, {"text": "two"}])
    assert load_task("ppl", cfg(tmp_path)).examples == [{"text": "one doc"}, {"text": "two"}]
    (tmp_path / "wiki").mkdir()
    (tmp_path / "wiki" / "test.txt").write_text("a whole\nfile")
    assert load_task("ppl:wiki", cfg(tmp_path)).examples == [{"text": "a whole\nfile"}]


# ------------------------------------------------------------------ errors
def test_missing_file_names_expected_paths_and_format(tmp_path):
    with pytest.raises(TaskDataError) as err:
        load_task("nq_open", cfg(tmp_path))
    msg = str(err.value)
    assert str(tmp_path / "nq_open" / "test.jsonl") in msg and "NQ-open.dev.jsonl" in msg and '"answer"' in msg
    with pytest.raises(TaskDataError, match=r"mmlu/test or .*mmlu/test.jsonl.*question,A,B,C,D,answer"):
        load_task("mmlu", cfg(tmp_path))
    with pytest.raises(ConfigError, match="eval.data_dir"):
        load_task("nq_open", EvalConfig())


def test_malformed_records_name_file_and_line(tmp_path):
    path = tmp_path / "nq_open" / "test.jsonl"
    path.parent.mkdir()
    path.write_text('{"question": "ok", "answer": ["a"]}\n{"question": "broken",\n')
    with pytest.raises(TaskDataError, match=rf"{path}:2: not valid JSON"):
        load_task("nq_open", cfg(tmp_path))
    path.write_text('{"question": "ok", "answer": ["a"]}\n{"question": "no answer"}\n')
    with pytest.raises(TaskDataError, match=rf"{path}:2: field 'answer': expected a string .* got nothing"):
        load_task("nq_open", cfg(tmp_path))
    write_jsonl(tmp_path / "piqa" / "test.jsonl", [{"question": "q", "choices": ["a", "b"], "answer": 2}])
    with pytest.raises(TaskDataError, match=r"test.jsonl:1: field 'answer': expected an index 0-1 into choices.*got 2"):
        load_task("piqa", cfg(tmp_path))
    (tmp_path / "mmlu" / "test").mkdir(parents=True)
    (tmp_path / "mmlu" / "test" / "law_test.csv").write_text("question,A,B,C,D,answer\nq,a,b,c,d,E\n")
    with pytest.raises(TaskDataError, match="law_test.csv:2: field 'answer': expected a letter A-D"):  # header skipped
        load_task("mmlu", cfg(tmp_path, num_fewshot=0))
    (tmp_path / "mmlu" / "test" / "law_test.csv").write_text("q,a,b,c\n")
    with pytest.raises(TaskDataError, match="law_test.csv:1: 4 columns, expected 6"):
        load_task("mmlu", cfg(tmp_path, num_fewshot=0))


def test_unknown_task_lists_known_tasks(tmp_path):
    with pytest.raises(ConfigError, match=r"eval.tasks='squad'.*nq_open, triviaqa.*mmlu.*qa:<folder>"):
        compose(["eval.tasks=[squad]"])
    with pytest.raises(ConfigError, match="known|one of"):
        load_task("qa:../etc", cfg(tmp_path))
    with pytest.raises(ConfigError, match="eval.task_fewshot"):
        EvalConfig(task_fewshot={"nope": 1}).validate()


def test_too_few_examples_for_the_shots(tmp_path):
    write_jsonl(tmp_path / "nq_open" / "test.jsonl", QA_ROWS[:2])
    with pytest.raises(TaskDataError, match="no examples left to evaluate"):
        load_task("nq_open", cfg(tmp_path, num_fewshot=5))
