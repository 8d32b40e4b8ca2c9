"""Loading one task: its evaluated examples and its few-shot examples.

Few-shot examples come from the task's pool file (train/dev) when it exists;
otherwise the first k evaluated examples become the shots and are removed
from the evaluated set, so an example is never its own demonstration.
`limit` then keeps the first N evaluated examples.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from memlm.config.eval import EvalConfig
from memlm.config.eval_tasks import FACTS_FORMAT, SYNTHETIC_QA_FILES, TaskSpec, task_spec
from memlm.data.config import DataConfig
from memlm.errors import ConfigError
from memlm.evals.formats import (
    TaskDataError,
    describe,
    find_file,
    find_optional,
    parse_choice,
    parse_qa,
    read_facts,
    read_mmlu,
    read_records,
    read_texts,
)


@dataclass
class TaskData:
    spec: TaskSpec
    examples: list[dict]
    shots: dict[str, list[dict]]  # by MMLU subject; other tasks use the key ""
    fewshot_source: str  # a file, or "first k evaluated examples"
    source: str = ""  # the evaluated file (or corpus), for the report


def load_task(name: str, cfg: EvalConfig, data_cfg: DataConfig | None = None) -> TaskData:
    spec = task_spec(name)
    k = cfg.fewshot_for(name) if spec.kind not in ("ppl", "bits") else 0
    if spec.name in SYNTHETIC_QA_FILES:
        (examples, source), pool = _synthetic_qa(data_cfg, spec.name), None
    elif spec.kind == "bits" and not spec.folder:
        (examples, source), pool = _facts(data_cfg, spec.name), None
    else:
        if not cfg.data_dir:
            raise ConfigError("eval.data_dir", cfg.data_dir,
                              f"the folder holding {spec.folder}/ for task {name} (see docs/evals.md)")
        folder = Path(cfg.data_dir) / spec.folder
        paths = find_file(folder, spec.eval_files, spec.format, name)
        pool_paths = find_optional(folder, spec.pool_files) if k else None
        examples, source = _read(spec, paths, None, "test"), describe(paths)
        pool = _read(spec, pool_paths, None if spec.kind == "mmlu" else k, "dev") if pool_paths else None
    if spec.kind == "mmlu":
        examples, shots, shot_source = _mmlu_shots(examples, pool, k, name)
    elif pool is not None:
        shots, shot_source = {"": pool[:k]}, describe(pool_paths)
        if len(pool) < k:
            raise TaskDataError(f"task {name}: {shot_source} has {len(pool)} examples, fewer than {k} shots")
    else:
        shots, shot_source = {"": examples[:k]}, f"first {k} evaluated examples" if k else "none"
        examples = examples[k:]
    if cfg.limit:
        examples = examples[: cfg.limit]
    if not examples:
        raise TaskDataError(f"task {name}: no examples left to evaluate (after {k} few-shot examples)")
    return TaskData(spec, examples, shots, shot_source, source)


# The fields each reader looks at: Parquet files are read for these columns only.
_QA_FIELDS = ("question", "Question", "answer", "Answer")
_CHOICE_FIELDS = ("context", "question", "choices", "answer")


def _read(spec: TaskSpec, paths: list[Path], limit: int | None, split: str) -> list[dict]:
    if spec.kind == "mmlu":
        return read_mmlu(paths, split, spec.format)
    if spec.kind == "ppl":
        return read_texts(paths, spec.format)
    if spec.kind == "bits":
        return read_facts(paths, spec.format)
    records = read_records(paths, spec.format, limit, _QA_FIELDS if spec.kind == "qa" else _CHOICE_FIELDS)
    if spec.kind == "qa":
        return [parse_qa(where, r, spec.reader, spec.format) for where, r in records]
    return [parse_choice(where, r, spec.format) for where, r in records]


def _mmlu_shots(examples: list[dict], pool: list[dict] | None, k: int, name: str):
    """Shots per subject: the first k of the subject's dev examples (the MMLU
    protocol), or without a dev split the first k of its test examples, removed."""
    by_subject: dict[str, list[dict]] = {}
    for ex in pool or []:
        by_subject.setdefault(ex["subject"], []).append(ex)
    shots: dict[str, list[dict]] = {}
    for subject in dict.fromkeys(ex["subject"] for ex in examples):
        if pool is not None:
            shots[subject] = by_subject.get(subject, [])[:k]
            if len(shots[subject]) < k:
                raise TaskDataError(f"task {name}: the dev split has {len(shots[subject])} examples of "
                                    f"subject {subject}, fewer than {k} shots")
        else:
            shots[subject] = [ex for ex in examples if ex["subject"] == subject][:k]
    skip = {id(ex) for s in shots.values() for ex in s}
    kept = [ex for ex in examples if id(ex) not in skip]
    source = "dev split" if pool is not None else (f"first {k} test examples per subject" if k else "none")
    return kept, shots, source


def _with_phrasing(example: dict, record: dict) -> dict:
    # The question's template (memlm.data.synthetic.phrasing_id): exact match is
    # also reported per phrasing. Corpora generated before it existed lack it.
    if isinstance(record.get("phrasing"), str):
        example["phrasing"] = record["phrasing"]
    return example


def synthetic_folder_of_shards(data_cfg: DataConfig | None) -> Path | None:
    """The synthetic corpus folder that `kind: shards` data was prepared from,
    else None. The shards' manifest names each source file; a synthetic
    corpus' train.jsonl sits next to its question files (qa*.jsonl)."""
    if data_cfg is None or getattr(data_cfg, "kind", "") != "shards" or not getattr(data_cfg, "shards_dir", ""):
        return None
    try:
        sources = json.loads((Path(data_cfg.shards_dir) / "manifest.json").read_text())["sources"].values()
    except (OSError, ValueError, KeyError, AttributeError):
        return None
    paths = [Path(s["path"]) for s in sources if isinstance(s, dict) and isinstance(s.get("path"), str)]
    folders = {p.parent for p in paths if p.name == "train.jsonl" and (p.parent / "qa.jsonl").is_file()}
    return folders.pop() if len(folders) == 1 else None


def _synthetic_qa(data_cfg: DataConfig | None, task: str = "synthetic_qa") -> tuple[list[dict], str]:
    """(the questions, their file) of the synthetic corpus the model was trained
    on: from the run's data config when it trained on the synthetic corpus
    (same people and facts; regenerated under data.cache_dir when missing), or
    from the corpus its shards were prepared from. Without a known synthetic
    training corpus this fails: questions about people the model never read
    would give a number that looks valid and means nothing. The _seen /
    _unseen tasks keep the people with / without QA training text; _trained
    asks the seen people's facts in the phrasings they were trained on.

    qa.jsonl lists each person's questions together; a seeded shuffle makes the
    shots (and a `limit` prefix) span many people instead of one person's facts."""
    split = SYNTHETIC_QA_FILES[task]
    if data_cfg is None:
        raise ConfigError("eval.tasks", task, "a model whose training corpus is known: a run checkpoint, or an "
                          "export that records the run's data config (memlm_data.json, written by "
                          "python -m memlm.hf.export; re-export an older export from its checkpoint); "
                          "in Python, run_suite(..., data_cfg=<the run's DataConfig>)")
    kind = getattr(data_cfg, "kind", "")
    synthetic = kind == "synthetic"
    folder = None if synthetic else synthetic_folder_of_shards(data_cfg)
    if not synthetic and folder is None:
        where = (f" from shards_dir={data_cfg.shards_dir!r}, whose manifest.json names no synthetic corpus "
                 "(train.jsonl next to qa.jsonl) that exists on this machine") if kind == "shards" else ""
        raise ConfigError("eval.tasks", task, "a model trained on the synthetic corpus (data=synthetic, or kind: "
                          f"shards prepared from one); this model trained on data.kind={kind!r}{where}")
    fraction = data_cfg.synthetic.qa_fraction if synthetic else None
    if synthetic and split == "qa_trained" and not fraction > 0:
        raise ConfigError("data.synthetic.qa_fraction", fraction,
                          f"a fraction > 0 in the run's config for task {task}, so that some people "
                          "have QA training text to be asked in; or task synthetic_qa")
    if synthetic and split in ("qa_seen", "qa_unseen") and not 0 < fraction < 1:
        raise ConfigError("data.synthetic.qa_fraction", fraction,
                          f"a fraction strictly between 0 and 1 in the run's config for task {task}, "
                          "so that both people with and without QA training text exist; or task synthetic_qa")
    if synthetic:
        from memlm.data.corpus import materialize_synthetic

        path = Path(materialize_synthetic(data_cfg)[split])
    else:  # shards prepared from a synthetic corpus (the demo): that corpus' questions
        path = folder / f"{split}.jsonl"
    where = f"synthetic {path.name}"
    examples = [_with_phrasing(parse_qa(w, r, "qa", where), r) for w, r in read_records(path, where)
                ] if path.is_file() else []
    if not examples:
        raise ConfigError("eval.tasks", task, f"a task with questions in {path.parent} ({path.name} is missing or "
                          "empty: the corpus was generated without the QA text this task asks about); "
                          "or task synthetic_qa")
    random.Random(0).shuffle(examples)
    return examples, str(path)


def _facts(data_cfg: DataConfig | None, task: str) -> list[dict]:
    """Every fact of the random-facts corpus the run trained on (all of them:
    capacity is a sum over the corpus, so `limit` is an estimate's sample only)."""
    if data_cfg is None or getattr(data_cfg, "kind", "") != "facts":
        raise ConfigError("eval.tasks", task, "a run trained on the random-facts corpus (data.kind=facts, "
                          f"memlm.data.facts); this run's data.kind is {getattr(data_cfg, 'kind', None)!r}")
    from memlm.data.corpus import materialize_facts

    path = Path(materialize_facts(data_cfg)["facts"])
    return read_facts(path, FACTS_FORMAT), str(path)
