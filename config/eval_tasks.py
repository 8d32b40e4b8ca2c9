"""The task names the harness knows, their kind and where their files live:
what `eval.tasks` may name.

    from memlm.config.eval_tasks import task_spec
    task_spec("nq_open").folder  # 'nq_open'; an unknown name raises ConfigError listing the known ones

Kept free of torch imports and in config/, below the harness (memlm.evals):
`EvalConfig.validate` (run by `compose()` in every process) checks task names
against this table, and the harness reads each task's files by it.

Kinds:
- `qa`: generative question answering, k-shot `Q: ...\\nA:` prompts, exact match + F1.
- `mmlu`: 4-way multiple choice scored by the log-likelihood of the letter.
- `choice`: multiple choice scored by the log-likelihood of each full answer text.
- `ppl`: perplexity and bits-per-byte of held-out text.
- `bits`: knowledge capacity: the bits of random facts a model stores, from the
  teacher-forced cross-entropy of each fact's value given its question.

Besides the fixed names, `qa:<folder>`, `choice:<folder>`, `ppl:<folder>` and
`bits:<folder>` evaluate a user's own files under `<data_dir>/<folder>/` in that kind's format.
"""

from __future__ import annotations

from dataclasses import dataclass

from memlm.errors import ConfigError


@dataclass(frozen=True)
class TaskSpec:
    name: str
    kind: str  # qa | mmlu | choice | ppl | bits
    folder: str  # under data_dir; "" for tasks that need no files
    eval_files: tuple[str, ...]  # first one that exists is evaluated; `*`: a glob of Parquet shards
    pool_files: tuple[str, ...] = ()  # few-shot pool; none found -> the first k eval examples
    reader: str = ""  # record parser, see formats.py
    format: str = ""  # what the files must look like, quoted in errors


QA_FORMAT = ('JSONL, JSON list or Parquet of {"question": str, "answer": str | [str, ...]}')
NQ_FORMAT = ('NQ-open JSONL (one {"question": str, "answer": [str, ...]} per line) or the Hugging Face '
             'Parquet (google-research-datasets/nq_open: columns question, answer)')
TRIVIAQA_FORMAT = ('TriviaQA JSONL or JSON ({"Data": [...]} or a list) of {"question": str, '
                   '"answer": {"aliases": [str], "value": str}} (or the release\'s Question/Answer.Aliases/Value); '
                   'or the Hugging Face Parquet '
                   '(mandarjoshi/trivia_qa: columns question, answer.value, answer.aliases)')
CHOICE_FORMAT = ('JSONL or Parquet of {"context" or "question": str, "choices": [str, ...], "answer": index}')
MMLU_FORMAT = ("MMLU CSV files test/<subject>_test.csv (+ dev/<subject>_dev.csv), rows "
               "question,A,B,C,D,answer (a header row naming these columns is skipped); or test.jsonl (+ dev.jsonl) of "
               '{"question": str, "choices": [4 str], "answer": index or letter, "subject": str}; or the Hugging '
               "Face Parquet (cais/mmlu: all/test-*.parquet + all/dev-*.parquet, the same columns)")
# The answer cue of the Q/A layout (memlm.evals.prompts.qa_text, memlm.data.facts.question):
# a facts file's question is the verbatim prompt and ends in it; the answer follows after one space.
ANSWER_CUE = "\nA:"
FACTS_FORMAT = ('a run trained on data.kind=facts (memlm.data.facts): its facts.jsonl of '
                '{"question": str, "answer": str, "values": int}')
FACTS_FILE_FORMAT = ('JSONL of {"question": str, "answer": str, "values": int >= 2} (one fact per line; '
                     'the facts.jsonl memlm.data.facts writes), the question ending in the answer cue, e.g. '
                     '{"question": "Q: What is the metal of Kavoru Tesilan?\\nA:", "answer": "rimo", "values": 256}')
PPL_FORMAT = ('JSONL or Parquet of {"text": str} (one document per record) or a plain UTF-8 text file (one document)')

# Hugging Face dataset repositories store each split as <split>-00000-of-0000N.parquet,
# in a folder named after the config when the dataset has several.
_CHOICE_EVAL = ("test.jsonl", "validation.jsonl", "test-*.parquet", "validation-*.parquet")
_CHOICE_POOL = ("train.jsonl", "dev.jsonl", "train-*.parquet", "dev-*.parquet")
_QA_EVAL = ("test.jsonl", "test.json", "test-*.parquet", "validation-*.parquet")
_QA_POOL = ("train.jsonl", "train.json", "train-*.parquet")
_PPL_EVAL = ("test.jsonl", "test.txt", "test-*.parquet")
_BITS_EVAL = ("facts.jsonl", "test.jsonl")
# TriviaQA's Hugging Face test split has no answers: only validation is evaluated. The
# no-context configs first (small files); rc.nocontext is the one lm-eval's triviaqa uses.
_TRIVIAQA_CONFIGS = ("", "rc.nocontext/", "unfiltered.nocontext/", "rc/", "unfiltered/")


def _choice(name: str) -> TaskSpec:
    return TaskSpec(name, "choice", name, _CHOICE_EVAL, _CHOICE_POOL, "choice", CHOICE_FORMAT)


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("nq_open", "qa", "nq_open",
                 ("test.jsonl", "validation.jsonl", "NQ-open.dev.jsonl", "validation-*.parquet",
                  "nq_open/validation-*.parquet"),
                 ("train.jsonl", "NQ-open.train.jsonl", "train-*.parquet", "nq_open/train-*.parquet"), "qa", NQ_FORMAT),
        TaskSpec("triviaqa", "qa", "triviaqa",
                 ("test.jsonl", "test.json", "validation.jsonl", "unfiltered-web-dev.json",
                  *(f"{c}validation-*.parquet" for c in _TRIVIAQA_CONFIGS)),
                 ("train.jsonl", "train.json", *(f"{c}train-*.parquet" for c in _TRIVIAQA_CONFIGS)),
                 "triviaqa", TRIVIAQA_FORMAT),
        TaskSpec("hotpotqa", "qa", "hotpotqa",
                 ("test.jsonl", "test.json", "hotpot_dev_distractor_v1.json", "validation-*.parquet",
                  "distractor/validation-*.parquet"),
                 ("train.jsonl", "train.json", "train-*.parquet", "distractor/train-*.parquet"), "qa", QA_FORMAT),
        # Generated in memory (or from the run's synthetic data config): no files.
        TaskSpec("synthetic_qa", "qa", "", (), (), "qa", QA_FORMAT),
        # ... only the people with QA-format training text, or only the biography-only ones
        # (data.synthetic.qa_fraction > 0): recall of a trained format vs knowledge extraction.
        TaskSpec("synthetic_qa_seen", "qa", "", (), (), "qa", QA_FORMAT),
        TaskSpec("synthetic_qa_unseen", "qa", "", (), (), "qa", QA_FORMAT),
        # ... the seen people's facts in the phrasings they were trained on: what the
        # model stored, apart from whether it understands a new phrasing.
        TaskSpec("synthetic_qa_trained", "qa", "", (), (), "qa", QA_FORMAT),
        TaskSpec("mmlu", "mmlu", "mmlu", ("test", "test.jsonl", "all/test-*.parquet", "test-*.parquet"),
                 ("dev", "dev.jsonl", "all/dev-*.parquet", "dev-*.parquet"), "mmlu", MMLU_FORMAT),
        _choice("openbookqa"),
        _choice("piqa"),
        _choice("hellaswag"),
        _choice("arc_easy"),
        _choice("arc_challenge"),
        TaskSpec("ppl", "ppl", "ppl", _PPL_EVAL, (), "ppl", PPL_FORMAT),
        # The random-facts corpus the run trained on (data.kind=facts): no files.
        TaskSpec("facts_bits", "bits", "", (), (), "", FACTS_FORMAT),
    )
}

# Synthetic-corpus tasks -> the corpus file they ask (memlm.data.synthetic).
SYNTHETIC_QA_FILES = {"synthetic_qa": "qa", "synthetic_qa_seen": "qa_seen", "synthetic_qa_unseen": "qa_unseen",
                      "synthetic_qa_trained": "qa_trained"}

# `<prefix>:<folder>`: the user's own data in a known format.
PREFIXES = {"qa": (QA_FORMAT, "qa"), "choice": (CHOICE_FORMAT, "choice"), "ppl": (PPL_FORMAT, "ppl"),
            "bits": (FACTS_FILE_FORMAT, "")}


def known_tasks() -> str:
    prefixes = ", ".join(f"{p}:<folder>" for p in PREFIXES)
    return f"one of: {', '.join(TASKS)}; or {prefixes} (files under data_dir/<folder>/)"


def task_spec(name: str, key: str = "eval.tasks") -> TaskSpec:
    """The spec of a task name; unknown names fail listing every known one."""
    if name in TASKS:
        return TASKS[name]
    prefix, sep, folder = name.partition(":")
    if sep and prefix in PREFIXES and folder and "/" not in folder and folder not in (".", ".."):
        fmt, reader = PREFIXES[prefix]
        if prefix == "qa":
            return TaskSpec(name, "qa", folder, _QA_EVAL, _QA_POOL, reader, fmt)
        if prefix == "choice":
            return TaskSpec(name, "choice", folder, _CHOICE_EVAL, _CHOICE_POOL, reader, fmt)
        if prefix == "bits":  # stored bits of any facts file, e.g. facts a fine-tune should keep
            return TaskSpec(name, "bits", folder, _BITS_EVAL, (), reader, fmt)
        return TaskSpec(name, "ppl", folder, _PPL_EVAL, (), reader, fmt)
    raise ConfigError(key, name, known_tasks())
