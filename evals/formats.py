"""Reading task files from data_dir into plain example dicts.

Every reader checks each record and fails on the first bad one with the file,
the line (text files) or row (Parquet, JSON lists; 0-based as the Hugging Face
viewer counts), the field and the format it expected: a half-read benchmark
would give a number that looks valid but is not comparable.

    paths = find_file(folder, ("test.jsonl", "validation-*.parquet"), fmt, "nq_open")
    records = read_records(paths, fmt)   # [(location, {"question": ..., ...}), ...]

A task file is JSONL, a JSON list, CSV (MMLU), plain text (perplexity) or
Parquet. Parquet comes as the Hugging Face dataset repositories lay it out:
`<split>-00000-of-00001.parquet`, possibly in several shards
(`<split>-00000-of-00003.parquet`, ...), which are read in order and must all
be present. Candidate names with a `*` are such glob patterns.

Example dicts:
- qa: {"question": str, "answers": [str, ...]} (answers[0] is the few-shot target)
- mmlu: {"question": str, "choices": [4 str], "answer": int, "subject": str}
- choice: {"context": str, "choices": [str, ...], "answer": int, "style": "context" | "question"}
- ppl: {"text": str}
- bits: {"question": str, "answer": str, "values": int} (the question is the
  verbatim prompt, ending in the answer cue: read_facts refuses a file with
  questions that do not)
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memlm.config.eval_tasks import ANSWER_CUE
from memlm.errors import MemlmError


class TaskDataError(MemlmError, ValueError):
    """A task file is missing or does not have the expected format."""


_SHARD = re.compile(r"-(\d+)-of-(\d+)\.parquet$")
_MISSING = object()


def _match(folder: Path, name: str) -> list[Path]:
    """The files `name` names in folder: itself, or a glob's complete shard set in order."""
    if "*" not in name:
        return [folder / name] if (folder / name).exists() else []
    paths = sorted(folder.glob(name))
    shards = [(m, p) for p in paths if (m := _SHARD.search(p.name))]
    if shards:
        total = int(shards[0][0].group(2))
        present = {int(m.group(1)) for m, _ in shards if int(m.group(2)) == total}
        if len(shards) != len(paths) or present != set(range(total)) or len(present) != len(shards):
            missing = sorted(set(range(total)) - present)
            raise TaskDataError(f"{folder / name}: an incomplete shard set {[p.name for p in paths]} "
                                f"(missing shard(s) {missing} of {total}); download every shard of the split")
    return paths


def find_file(folder: Path, candidates: tuple[str, ...], fmt: str, task: str, role: str = "evaluation") -> list[Path]:
    """The first candidate that exists (a file, a folder, or all shards of a glob)."""
    found = find_optional(folder, candidates)
    if found:
        return found
    expected = " or ".join(str(folder / n) for n in candidates)
    raise TaskDataError(f"task {task}: no {role} file: expected {expected} ({fmt}); see docs/evals.md")


def find_optional(folder: Path, candidates: tuple[str, ...]) -> list[Path] | None:
    return next((paths for name in candidates if (paths := _match(folder, name))), None)


def describe(paths: Sequence[Path]) -> str:
    """One line for a report: the file, or the first shard and how many follow."""
    return str(paths[0]) if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} more shards)"


def _decode(raw: bytes, path: Path, line: int, fmt: str) -> str:
    try:
        return raw.decode("utf-8-sig" if line == 1 else "utf-8")  # a BOM (Excel, Notepad) is not data
    except UnicodeDecodeError as err:
        line += raw.count(b"\n", 0, err.start)
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        raise TaskDataError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column {column}); "
                            f"re-save the file as UTF-8; expected {fmt}") from None


def read_text(path: Path, fmt: str) -> str:
    """A whole text file, with the file and line of a byte that is not UTF-8."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise TaskDataError(f"{path}: cannot be read ({err.strerror or err}); expected {fmt}") from None
    return _decode(raw, path, 1, fmt)


def read_records(paths: Path | Sequence[Path], fmt: str, limit: int | None = None,
                 fields: tuple[str, ...] = ()) -> list[tuple[str, dict]]:
    """(location, record) pairs of JSONL, a JSON list ({"Data"/"data": [...]} too) or
    Parquet files, in order. `limit` stops early: few-shot pools only need their
    first k records. `fields`: the Parquet columns to read (others are skipped:
    TriviaQA's rc files carry megabytes of context per row); () reads all."""
    records: list[tuple[str, dict]] = []
    for path in [paths] if isinstance(paths, Path) else paths:
        want = limit - len(records) if limit else None
        if path.suffix == ".parquet":
            records += _parquet_records(path, fmt, want, fields)
        elif path.suffix == ".json":
            records += _json_records(path, fmt, want)
        else:
            records += _jsonl_records(path, fmt, want)
        if limit and len(records) >= limit:
            break
    for where, record in records:
        if not isinstance(record, dict):
            raise TaskDataError(f"{where}: expected a JSON object, got {_show(record)}; format: {fmt}")
    return records


def _json_records(path: Path, fmt: str, limit: int | None) -> list[tuple[str, Any]]:
    try:
        data = json.loads(read_text(path, fmt))
    except json.JSONDecodeError as err:
        raise TaskDataError(f"{path}:{err.lineno}: not valid JSON ({err.msg}); expected {fmt}") from None
    if isinstance(data, dict):
        data = data.get("Data", data.get("data"))
    if not isinstance(data, list):
        raise TaskDataError(f"{path}: expected a JSON list of records or {{\"Data\": [...]}}; format: {fmt}")
    return [(f"{path}[{i}]", r) for i, r in enumerate(data[:limit] if limit else data)]


def _jsonl_records(path: Path, fmt: str, limit: int | None) -> list[tuple[str, Any]]:
    records = []
    try:
        fh = open(path, "rb")  # bytes: a bad byte is reported with its line, not as a bare UnicodeDecodeError
    except OSError as err:
        raise TaskDataError(f"{path}: cannot be read ({err.strerror or err}); expected {fmt}") from None
    with fh:
        for line_no, raw in enumerate(fh, 1):
            line = _decode(raw, path, line_no, fmt)
            if not line.strip():
                continue
            try:
                records.append((f"{path}:{line_no}", json.loads(line)))
            except json.JSONDecodeError as err:
                raise TaskDataError(f"{path}:{line_no}: not valid JSON ({err.msg}); expected {fmt}") from None
            if limit and len(records) >= limit:
                break
    return records


def _parquet_records(path: Path, fmt: str, limit: int | None, fields: tuple[str, ...]) -> list[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    records: list[tuple[str, Any]] = []
    try:
        parquet = pq.ParquetFile(path)
        columns = [c for c in parquet.schema_arrow.names if c in fields] if fields else None
        for batch in parquet.iter_batches(batch_size=1024, columns=columns):
            records += [(f"{path} row {len(records) + i}", row) for i, row in enumerate(batch.to_pylist())]
            if limit and len(records) >= limit:
                return records[:limit]
    except (OSError, pa.ArrowException) as err:
        raise TaskDataError(f"{path}: not a readable Parquet file ({err}); expected {fmt}") from None
    return records


def _show(value: Any) -> str:
    if value is _MISSING:
        return "nothing (the field is missing)"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _field_error(where: str, field: str, value: Any, expected: str, fmt: str) -> TaskDataError:
    return TaskDataError(f"{where}: field {field!r}: expected {expected}, got {_show(value)}; format: {fmt}")


def _get(record: dict, *keys: str) -> Any:
    return next((record[k] for k in keys if k in record), _MISSING)


def _strings(value: Any) -> list[str] | None:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def parse_qa(where: str, record: dict, reader: str, fmt: str) -> dict:
    question = _get(record, "question", "Question")
    if not isinstance(question, str) or not question.strip():
        raise _field_error(where, "question", question, "a non-empty string", fmt)
    if reader == "triviaqa":
        answer = _get(record, "answer", "Answer")
        if not isinstance(answer, dict):
            raise _field_error(where, "answer", answer, 'an object {"value": str, "aliases": [str, ...]}', fmt)
        value, aliases = _get(answer, "value", "Value"), _get(answer, "aliases", "Aliases")
        if not isinstance(value, str) or not value.strip():
            raise _field_error(where, "answer.value", value, "a non-empty string", fmt)
        aliases = [] if aliases is _MISSING or aliases is None else aliases
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise _field_error(where, "answer.aliases", aliases, "a list of strings", fmt)
        answers = [value, *aliases]
    else:
        answer = _get(record, "answer")
        answers = _strings(answer)
        if answers is None:
            raise _field_error(where, "answer", answer, "a string or a non-empty list of strings", fmt)
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
    text, choices = _get(record, style), _get(record, "choices")
    if not isinstance(text, str):
        raise _field_error(where, style, text, 'a string (a record has "context" or "question")', fmt)
    if _strings(choices) is None or not isinstance(choices, list) or len(choices) < 2:
        raise _field_error(where, "choices", choices, "a list of at least 2 strings", fmt)
    answer = _get(record, "answer")
    index = _answer_index(answer, len(choices))
    if index is None:
        raise _field_error(where, "answer", answer, f"an index 0-{len(choices) - 1} into choices "
                           f"(or a letter A-{chr(ord('A') + len(choices) - 1)})", fmt)
    return {"context": text, "choices": list(choices), "answer": index, "style": style}


def _mmlu_example(where: str, question: Any, choices: Any, answer: Any, subject: Any, fmt: str) -> dict:
    if not isinstance(question, str):
        raise _field_error(where, "question", question, "a string", fmt)
    if _strings(choices) is None or not isinstance(choices, list) or len(choices) != 4:
        raise _field_error(where, "choices", choices, "a list of 4 strings", fmt)
    index = _answer_index(answer, 4)
    if index is None:
        raise _field_error(where, "answer", answer, "a letter A-D or an index 0-3", fmt)
    if not isinstance(subject, str) or not subject:
        raise _field_error(where, "subject", subject, "a non-empty string", fmt)
    return {"question": question, "choices": list(choices), "answer": index, "subject": subject}


# A first CSV row naming the columns (question,A,B,C,D,answer; some copies say input/target).
_HEADER_FIRST, _HEADER_LAST = ("question", "input", "prompt"), ("answer", "target", "label")


def _is_header(row: list[str]) -> bool:
    return (len(row) == 6 and row[0].strip().lower() in _HEADER_FIRST and row[5].strip().lower() in _HEADER_LAST)


def read_mmlu(paths: Sequence[Path], split: str, fmt: str) -> list[dict]:
    """MMLU from a folder of <subject>_<split>.csv files (the original release),
    JSONL, or the Hugging Face Parquet files (cais/mmlu: answer a class index 0-3)."""
    if len(paths) == 1 and paths[0].is_dir():
        folder = paths[0]
        files = sorted(folder.glob(f"*_{split}.csv"))
        if not files:
            raise TaskDataError(f"{folder}: no *_{split}.csv files; expected {fmt}")
        examples = []
        for file in files:
            subject = file.name[: -len(f"_{split}.csv")]
            rows = csv.reader(io.StringIO(read_text(file, fmt), newline=""))
            for row_no, row in enumerate(rows, 1):
                if row_no == 1 and _is_header(row):
                    continue  # a header row names the columns; it is not a question
                if len(row) != 6:
                    raise TaskDataError(f"{file}:{row_no}: {len(row)} columns, expected 6 "
                                        f"(question,A,B,C,D,answer); format: {fmt}")
                examples.append(_mmlu_example(f"{file}:{row_no}", row[0], row[1:5], row[5].strip(), subject, fmt))
        return examples
    return [
        _mmlu_example(where, r.get("question"), r.get("choices"), r.get("answer"), r.get("subject", "all"), fmt)
        for where, r in read_records(paths, fmt, fields=("question", "choices", "answer", "subject"))
    ]


def read_texts(paths: Sequence[Path], fmt: str) -> list[dict]:
    """Held-out documents: {"text": ...} records (JSONL, Parquet), or a whole plain-text file as one document."""
    if paths[0].suffix in (".jsonl", ".json", ".parquet"):
        docs = []
        for where, record in read_records(paths, fmt, fields=("text",)):
            if not isinstance(record.get("text"), str):
                raise _field_error(where, "text", record.get("text", _MISSING), "a string", fmt)
            docs.append({"text": record["text"]})
        return docs
    return [{"text": read_text(paths[0], fmt)}]


def read_facts(paths: Path | Sequence[Path], fmt: str) -> list[dict]:
    """[{"question", "answer", "values"}] of a facts file. A malformed record fails
    naming its line. The answer is scored after its question and one space, so
    the question must be the prompt the model read before the answer in
    training: a question without the answer cue (`"What is the metal of X?"`
    for the trained `"Q: What is the metal of X?\\nA: rimo"`) would score about
    0 bits on a model that stored the fact. A file with any such question is
    refused, counting them and showing the first: a number over a mix of
    prompts is not comparable."""
    examples, uncued = [], []
    for where, r in read_records(paths, fmt):
        question, answer, values = (r.get(k, _MISSING) for k in ("question", "answer", "values"))
        if not isinstance(question, str):
            raise _field_error(where, "question", question, "a string", fmt)
        if not (isinstance(answer, str) and answer and answer == answer.strip()):
            raise _field_error(where, "answer", answer, "a non-empty string without surrounding whitespace "
                               "(it is scored after one space)", fmt)
        if not (isinstance(values, int) and values >= 2):
            raise _field_error(where, "values", values, "an integer >= 2 (the value's candidates)", fmt)
        if not question.endswith(ANSWER_CUE):
            uncued.append((where, question))
        examples.append({"question": question, "answer": answer, "values": values})
    if uncued:
        where, question = uncued[0]
        source = describe([paths] if isinstance(paths, Path) else paths)
        raise TaskDataError(f"{source}: {len(uncued)} of {len(examples)} questions do not end in the answer cue "
                            f"{ANSWER_CUE!r} (first: {where}: {_show(question)}): a question is the verbatim prompt "
                            "the answer follows, and without the cue a model that stored the facts scores about "
                            f"0 bits; format: {fmt}")
    return examples
