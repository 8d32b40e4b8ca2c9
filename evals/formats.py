"""Reading task files from data_dir into plain example dicts.

Every reader checks each record and fails on the first bad one with the file
(and line) and the format it expected: a half-read benchmark would give a
number that looks valid but is not comparable.

Example dicts:
- qa: {"question": str, "answers": [str, ...]} (answers[0] is the few-shot target)
- mmlu: {"question": str, "choices": [4 str], "answer": int, "subject": str}
- choice: {"context": str, "choices": [str, ...], "answer": int, "style": "context" | "question"}
- ppl: {"text": str}
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any


class TaskDataError(ValueError):
    """A task file is missing or does not have the expected format."""


def find_file(folder: Path, candidates: tuple[str, ...], fmt: str, task: str, role: str = "evaluation") -> Path:
    for name in candidates:
        if (folder / name).exists():
            return folder / name
    expected = " or ".join(str(folder / n) for n in candidates)
    raise TaskDataError(f"task {task}: no {role} file: expected {expected} ({fmt}); see docs/evals.md")


def find_optional(folder: Path, candidates: tuple[str, ...]) -> Path | None:
    return next((folder / n for n in candidates if (folder / n).exists()), None)


def read_records(path: Path, fmt: str, limit: int | None = None) -> list[tuple[str, dict]]:
    """(location, record) pairs of a JSONL file or a JSON list ({"Data"/"data": [...]} too).
    `limit` stops early: few-shot pools only need their first k records."""
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise TaskDataError(f"{path}: not valid JSON ({err}); expected {fmt}") from None
        if isinstance(data, dict):
            data = data.get("Data", data.get("data"))
        if not isinstance(data, list):
            raise TaskDataError(f"{path}: expected a JSON list of records or {{\"Data\": [...]}}; format: {fmt}")
        records = [(f"{path}[{i}]", r) for i, r in enumerate(data[:limit] if limit else data)]
    else:
        records = []
        with open(path, encoding="utf-8") as fh:
            for line_no, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    records.append((f"{path}:{line_no}", json.loads(line)))
                except json.JSONDecodeError as err:
                    raise TaskDataError(f"{path}:{line_no}: not valid JSON ({err.msg}); expected {fmt}") from None
                if limit and len(records) >= limit:
                    break
    for where, record in records:
        if not isinstance(record, dict):
            raise TaskDataError(f"{where}: expected a JSON object; format: {fmt}")
    return records


def _strings(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def parse_qa(where: str, record: dict, reader: str, fmt: str) -> dict:
    question = record.get("question", record.get("Question"))
    if reader == "triviaqa":
        answer = record.get("answer", record.get("Answer"))
        if isinstance(answer, dict):
            value = answer.get("value", answer.get("Value"))
            aliases = answer.get("aliases", answer.get("Aliases")) or []
            answers = _strings([value, *aliases]) if isinstance(value, str) else None
        else:
            answers = None
    else:
        answers = _strings(record.get("answer"))
    if not isinstance(question, str) or not question.strip() or not answers:
        raise TaskDataError(f"{where}: missing or malformed question/answer; expected {fmt}")
    return {"question": question.strip(), "answers": list(dict.fromkeys(answers))}


def _answer_index(value: Any, n: int) -> int | None:
    if isinstance(value, str) and len(value) == 1 and "A" <= value.upper() < chr(ord("A") + n):
        return ord(value.upper()) - ord("A")
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n:
        return value
    return None


def parse_choice(where: str, record: dict, fmt: str) -> dict:
    # "context": the choices continue the text (HellaSwag); "question": a Q/A prompt (OBQA, PIQA).
    style = "context" if "context" in record else "question"
    text, choices = record.get(style), record.get("choices")
    answer = _answer_index(record.get("answer"), len(choices) if isinstance(choices, list) else 0)
    if not isinstance(text, str) or _strings(choices) is None or len(choices) < 2 or answer is None:
        raise TaskDataError(f"{where}: missing or malformed context/question, choices or answer; expected {fmt}")
    return {"context": text, "choices": list(choices), "answer": answer, "style": style}


def _mmlu_example(where: str, question: Any, choices: Any, answer: Any, subject: str, fmt: str) -> dict:
    index = _answer_index(answer, 4)
    if not isinstance(question, str) or _strings(choices) is None or len(choices) != 4 or index is None:
        raise TaskDataError(f"{where}: malformed MMLU record (question, 4 choices, answer A-D or 0-3); expected {fmt}")
    return {"question": question, "choices": list(choices), "answer": index, "subject": subject}


def read_mmlu(path: Path, split: str, fmt: str) -> list[dict]:
    """MMLU from a folder of <subject>_<split>.csv files (the original release) or one JSONL."""
    if path.is_dir():
        files = sorted(path.glob(f"*_{split}.csv"))
        if not files:
            raise TaskDataError(f"{path}: no *_{split}.csv files; expected {fmt}")
        examples = []
        for file in files:
            subject = file.name[: -len(f"_{split}.csv")]
            with open(file, encoding="utf-8", newline="") as fh:
                for row_no, row in enumerate(csv.reader(fh), 1):
                    if len(row) != 6:
                        raise TaskDataError(f"{file}:{row_no}: {len(row)} columns, expected 6 "
                                            f"(question,A,B,C,D,answer; no header); format: {fmt}")
                    examples.append(_mmlu_example(f"{file}:{row_no}", row[0], row[1:5], row[5].strip(), subject, fmt))
        return examples
    return [
        _mmlu_example(where, r.get("question"), r.get("choices"), r.get("answer"), str(r.get("subject", "all")), fmt)
        for where, r in read_records(path, fmt)
    ]


def read_texts(path: Path, fmt: str) -> list[dict]:
    """Held-out documents: JSONL {"text": ...} records, or a whole plain-text file as one document."""
    if path.suffix in (".jsonl", ".json"):
        docs = []
        for where, record in read_records(path, fmt):
            if not isinstance(record.get("text"), str):
                raise TaskDataError(f"{where}: missing or non-string \"text\"; expected {fmt}")
            docs.append({"text": record["text"]})
        return docs
    try:
        return [{"text": path.read_text(encoding="utf-8")}]
    except UnicodeDecodeError as err:
        raise TaskDataError(f"{path}: not UTF-8 text ({err}); expected {fmt}") from None
