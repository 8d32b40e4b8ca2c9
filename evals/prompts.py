"""Prompt text of each task kind: k-shot examples, then the evaluated example.

The layouts are lm-eval's (shots joined by a blank line, the target after a
single space), so the same task written as an lm-eval YAML (docs/evals.md)
sends the model exactly the same strings.
"""

from __future__ import annotations

LETTERS = "ABCD"
SHOT_SEPARATOR = "\n\n"
TARGET_DELIMITER = " "


def _join(shots: list[str], query: str, description: str = "") -> str:
    return description + "".join(s + SHOT_SEPARATOR for s in shots) + query


# ----------------------------------------------------------- generative QA
def qa_text(question: str) -> str:
    # NQ-open questions have no question mark; the prompt always ends the question with one.
    q = question.strip()
    return f"Q: {q if q.endswith('?') else q + '?'}\nA:"


def qa_prompt(shots: list[dict], question: str) -> str:
    return _join([qa_text(s["question"]) + TARGET_DELIMITER + s["answers"][0] for s in shots], qa_text(question))


# ------------------------------------------------------------------- MMLU
def mmlu_description(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def mmlu_text(example: dict) -> str:
    options = "".join(f"{letter}. {choice}\n" for letter, choice in zip(LETTERS, example["choices"]))
    return f"{example['question'].strip()}\n{options}Answer:"


def mmlu_prompt(shots: list[dict], example: dict) -> str:
    demos = [mmlu_text(s) + TARGET_DELIMITER + LETTERS[s["answer"]] for s in shots]
    return _join(demos, mmlu_text(example), mmlu_description(example["subject"]))


def mmlu_continuations() -> list[str]:
    return [TARGET_DELIMITER + letter for letter in LETTERS]


# ------------------------------------------------- continuation-scored choice
def choice_text(example: dict) -> str:
    # A context is continued by the choice as is (HellaSwag); a question gets a Q/A frame (PIQA, OBQA).
    if example["style"] == "context":
        return example["context"]
    return f"Question: {example['context']}\nAnswer:"


def choice_prompt(shots: list[dict], example: dict) -> str:
    demos = [choice_text(s) + TARGET_DELIMITER + s["choices"][s["answer"]] for s in shots]
    return _join(demos, choice_text(example))


def choice_continuations(example: dict) -> list[str]:
    return [TARGET_DELIMITER + c for c in example["choices"]]
