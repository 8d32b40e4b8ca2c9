"""Benchmark files as users download them: the Hugging Face Parquet layouts of
nq_open, trivia_qa and cais/mmlu give the numbers of their JSONL/CSV
equivalents through the real harness; NQ's validation.jsonl; errors that name
the file, line or row and field; MMLU CSV header rows; synthetic_qa on an
export asks about the corpus the run trained on; the command line checks its
paths before the model load; the lm-eval adapter's arguments and progress."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from evals_fixtures import (
    MMLU_ROWS,
    QA_ROWS,
    make_model,
    make_tokenizer,
    write_jsonl,
    write_mmlu_csv,
)

from memlm.config.eval import EvalConfig
from memlm.errors import ConfigError
from memlm.evals.formats import TaskDataError
from memlm.evals.suite import run_suite
from memlm.evals.tasks import load_task

SUBJECTS = {"high_school_math": MMLU_ROWS, "biology": MMLU_ROWS[::-1]}


# ------------------------------------------------ fixtures in the HF schemas
def write_parquet(path: Path, table: pa.Table) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def nq_table(rows: list[dict]) -> pa.Table:
    # google-research-datasets/nq_open: question: string, answer: list<string>
    return pa.table({"question": [r["question"] for r in rows], "answer": [r["answer"] for r in rows]})


def triviaqa_table(rows: list[dict]) -> pa.Table:
    """mandarjoshi/trivia_qa (rc.nocontext): the answer is a struct; the context
    structs are empty in the nocontext configs."""
    answer = [{"aliases": r["answer"][1:], "normalized_aliases": [a.lower() for a in r["answer"][1:]],
               "matched_wiki_entity_name": "", "normalized_matched_wiki_entity_name": "",
               "normalized_value": r["answer"][0].lower(), "type": "WikipediaEntity", "value": r["answer"][0]}
              for r in rows]
    pages = [{"doc_source": [], "filename": [], "title": [], "wiki_context": []} for _ in rows]
    return pa.table({"question": [r["question"] for r in rows],
                     "question_id": [f"tc_{i}" for i in range(len(rows))],
                     "question_source": ["http://www.triviaquiz.com/"] * len(rows),
                     "entity_pages": pages, "answer": answer})


def mmlu_table(subjects: dict[str, list[tuple]]) -> pa.Table:
    # cais/mmlu (all): question, subject, choices: list<string>, answer: ClassLabel 0-3 (int64)
    # The "all" config lists the subjects in alphabetical order, as the CSV files sort.
    rows = [(q, s, list(c), "ABCD".index(a)) for s in sorted(subjects) for q, *c, a in subjects[s]]
    return pa.table({"question": [r[0] for r in rows], "subject": [r[1] for r in rows],
                     "choices": [r[2] for r in rows], "answer": pa.array([r[3] for r in rows], pa.int64())})


def write_both_layouts(root: Path, qa_test: list[dict], qa_train: list[dict]) -> tuple[Path, Path]:
    """The same questions twice: as the original releases (JSONL, CSV) and as
    the Hugging Face repositories download (Parquet in their folders; TriviaQA's
    validation split in two shards)."""
    plain, hf = root / "plain", root / "hf"
    write_jsonl(plain / "nq_open" / "NQ-open.dev.jsonl", qa_test)
    write_jsonl(plain / "nq_open" / "NQ-open.train.jsonl", qa_train)
    trivia = [{"question": r["question"], "answer": {"value": r["answer"][0], "aliases": r["answer"][1:]}}
              for r in qa_test]
    write_jsonl(plain / "triviaqa" / "validation.jsonl", trivia)
    write_jsonl(plain / "triviaqa" / "train.jsonl", [{"question": r["question"], "answer": {
        "value": r["answer"][0], "aliases": r["answer"][1:]}} for r in qa_train])
    for split in ("test", "dev"):
        write_mmlu_csv(plain, SUBJECTS, split)
    write_parquet(hf / "nq_open" / "nq_open" / "validation-00000-of-00001.parquet", nq_table(qa_test))
    write_parquet(hf / "nq_open" / "nq_open" / "train-00000-of-00001.parquet", nq_table(qa_train))
    half = len(qa_test) // 2
    for i, part in enumerate((qa_test[:half], qa_test[half:])):
        write_parquet(hf / "triviaqa" / "rc.nocontext" / f"validation-0000{i}-of-00002.parquet", triviaqa_table(part))
    write_parquet(hf / "triviaqa" / "rc.nocontext" / "train-00000-of-00001.parquet", triviaqa_table(qa_train))
    for split in ("test", "dev"):
        write_parquet(hf / "mmlu" / "all" / f"{split}-00000-of-00001.parquet", mmlu_table(SUBJECTS))
    return plain, hf


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok")), make_model(max_seq_len=512)


def _suite(lm, data_dir: Path, out_dir: Path):
    tokenizer, model = lm
    cfg = EvalConfig(tasks=["nq_open", "triviaqa", "mmlu"], data_dir=str(data_dir), num_fewshot=2,
                     max_new_tokens=8, batch_size=4, log_samples=True)
    results = run_suite(model, tokenizer, cfg, 0, out_dir)
    report = json.loads((out_dir / "0.json").read_text())
    return results, report["tasks"], (out_dir / "0_samples.jsonl").read_text()


def test_hf_parquet_layouts_give_the_jsonl_and_csv_numbers(lm, tmp_path):
    qa = QA_ROWS * 2
    write_both_layouts(tmp_path / "probe", qa, QA_ROWS[:2])
    _, _, probe = _suite(lm, tmp_path / "probe" / "plain", tmp_path / "probe_out")
    # Gold answers from the model's own predictions for every other question, so
    # exact match is neither 0 nor 1 and any difference in reading shows in it.
    predictions = [s["prediction"] for s in map(json.loads, probe.splitlines()) if s["task"] == "nq_open"]
    qa_test = [{"question": r["question"], "answer": [p, "zebra"] if i % 2 == 0 and p else ["zebra crossing"]}
               for i, (r, p) in enumerate(zip(qa, predictions, strict=True))]
    plain, hf = write_both_layouts(tmp_path, qa_test, QA_ROWS[:2])
    plain_results, plain_tasks, plain_samples = _suite(lm, plain, tmp_path / "plain_out")
    hf_results, hf_tasks, hf_samples = _suite(lm, hf, tmp_path / "hf_out")
    assert 0 < plain_results["nq_open"]["exact_match"] < 1 and 0 < plain_results["triviaqa"]["exact_match"] < 1
    assert plain_results["mmlu"]["n"] == 8 and set(plain_results) >= {"mmlu/biology", "mmlu/high_school_math"}
    assert hf_results == plain_results
    assert hf_samples == plain_samples  # every prompt, prediction and log-likelihood
    # The Parquet files were the ones read (and the report says which).
    assert hf_tasks["nq_open"]["source"].endswith("nq_open/nq_open/validation-00000-of-00001.parquet")
    assert hf_tasks["nq_open"]["fewshot_source"].endswith("train-00000-of-00001.parquet")
    assert hf_tasks["triviaqa"]["source"].endswith("validation-00000-of-00002.parquet (+1 more shards)")
    assert hf_tasks["mmlu"]["source"].endswith("mmlu/all/test-00000-of-00001.parquet")
    assert plain_tasks["mmlu"]["source"].endswith("mmlu/test")


def test_parquet_for_the_other_kinds(tmp_path):
    rows = [{"question": "q?", "choices": ["a", "b"], "answer": 1}] * 3
    write_parquet(tmp_path / "piqa" / "validation-00000-of-00001.parquet", pa.Table.from_pylist(rows))
    assert load_task("piqa", EvalConfig(data_dir=str(tmp_path), num_fewshot=1)).examples[0]["answer"] == 1
    write_parquet(tmp_path / "ppl" / "test-00000-of-00001.parquet", pa.table({"text": ["one doc", "two"]}))
    assert load_task("ppl", EvalConfig(data_dir=str(tmp_path))).examples == [{"text": "one doc"}, {"text": "two"}]
    write_parquet(tmp_path / "mine" / "test-00000-of-00001.parquet", nq_table(QA_ROWS))
    assert len(load_task("qa:mine", EvalConfig(data_dir=str(tmp_path), num_fewshot=0)).examples) == len(QA_ROWS)


def test_nq_open_reads_validation_jsonl(tmp_path):
    write_jsonl(tmp_path / "nq_open" / "validation.jsonl", QA_ROWS)
    task = load_task("nq_open", EvalConfig(data_dir=str(tmp_path), num_fewshot=0))
    assert task.source.endswith("nq_open/validation.jsonl") and len(task.examples) == len(QA_ROWS)


# --------------------------------------------------------------------- errors
def _error(name: str, root: Path, **kw) -> str:
    with pytest.raises(TaskDataError) as err:
        load_task(name, EvalConfig(data_dir=str(root), **kw))
    return str(err.value)


def test_non_utf8_files_name_the_file_and_line(tmp_path):
    latin1 = '{"question": "caf\xe9?", "answer": ["x"]}\n'.encode("latin-1")
    path = tmp_path / "nq_open" / "test.jsonl"
    path.parent.mkdir()
    path.write_bytes(b'{"question": "ok?", "answer": ["a"]}\n' + latin1)
    assert f"{path}:2: not UTF-8 text (byte 0xe9 at column 18)" in _error("nq_open", tmp_path)
    csv_path = tmp_path / "mmlu" / "test" / "law_test.csv"
    csv_path.parent.mkdir(parents=True)
    csv_path.write_bytes(b"q,a,b,c,d,A\nq2,\xff,b,c,d,B\n")
    assert f"{csv_path}:2: not UTF-8 text" in _error("mmlu", tmp_path, num_fewshot=0)
    (tmp_path / "triviaqa").mkdir()
    (tmp_path / "triviaqa" / "unfiltered-web-dev.json").write_bytes(b'{"Data": [\n{"Question": "\xe9"}]}')
    assert "unfiltered-web-dev.json:2: not UTF-8 text" in _error("triviaqa", tmp_path)
    (tmp_path / "ppl").mkdir()
    (tmp_path / "ppl" / "test.txt").write_bytes(b"line one\nline two \x80\n")
    assert "test.txt:2: not UTF-8 text (byte 0x80 at column 10)" in _error("ppl", tmp_path)
    # A UTF-8 byte-order mark (Excel, Notepad) is not data.
    path.write_bytes(b"\xef\xbb\xbf" + b'{"question": "ok?", "answer": ["a"]}\n')
    assert load_task("nq_open", EvalConfig(data_dir=str(tmp_path), num_fewshot=0)).examples[0]["question"] == "ok?"


def test_malformed_parquet_names_file_row_and_field(tmp_path):
    folder = tmp_path / "nq_open" / "nq_open"
    bad = write_parquet(folder / "validation-00000-of-00001.parquet",
                        pa.table({"question": ["q1", "q2"], "answers": [["a"], ["b"]]}))  # a misnamed column
    assert f"{bad} row 0: field 'answer': expected a string or a non-empty list of strings, got nothing" in \
        _error("nq_open", tmp_path, num_fewshot=0)
    write_parquet(bad, pa.table({"question": ["q1", "q2"], "answer": [["a"], []]}))
    assert f"{bad} row 1: field 'answer'" in _error("nq_open", tmp_path, num_fewshot=0)
    bad.write_text("not parquet")
    assert f"{bad}: not a readable Parquet file" in _error("nq_open", tmp_path, num_fewshot=0)
    bad.unlink()
    write_parquet(folder / "validation-00001-of-00003.parquet", nq_table(QA_ROWS))
    assert "missing shard(s) [0, 2] of 3" in _error("nq_open", tmp_path, num_fewshot=0)
    table = triviaqa_table([{"question": "q", "answer": ["v", "alias"]}]).to_pylist()
    table[0]["answer"]["value"] = None
    tq = write_parquet(tmp_path / "triviaqa" / "validation-00000-of-00001.parquet", pa.Table.from_pylist(table))
    assert f"{tq} row 0: field 'answer.value': expected a non-empty string, got None" in \
        _error("triviaqa", tmp_path, num_fewshot=0)
    rows = mmlu_table(SUBJECTS).to_pylist()
    rows[5]["answer"] = 4
    mm = write_parquet(tmp_path / "mmlu" / "all" / "test-00000-of-00001.parquet", pa.Table.from_pylist(rows))
    assert f"{mm} row 5: field 'answer': expected a letter A-D or an index 0-3, got 4" in \
        _error("mmlu", tmp_path, num_fewshot=0)


def test_mmlu_csv_header_row_is_skipped(tmp_path):
    write_mmlu_csv(tmp_path / "a", SUBJECTS, "test")
    write_mmlu_csv(tmp_path / "b", {s: [("question", "A", "B", "C", "D", "answer"), *r] for s, r in SUBJECTS.items()},
                   "test")
    plain, header = (load_task("mmlu", EvalConfig(data_dir=str(tmp_path / d), num_fewshot=1)) for d in "ab")
    assert header.examples == plain.examples and header.shots == plain.shots and len(plain.examples) == 6
    # Only a first row that names the columns: a data row named "question" is still data (and checked).
    write_mmlu_csv(tmp_path / "c", {"law": [MMLU_ROWS[0], ("question", "A", "B", "C", "D", "answer")]}, "test")
    assert "law_test.csv:2: field 'answer'" in _error("mmlu", tmp_path / "c", num_fewshot=0)


# ------------------------------------------------------------- synthetic_qa
def test_synthetic_qa_on_an_export_asks_about_the_runs_corpus(tmp_path):
    from memlm.config.run import compose
    from memlm.hf.pretrained import write_manifest  # each state of the folder, as an export would write it
    from memlm.run.export import write_data_config
    from memlm.run.load import DATA_CONFIG_NAME, data_config

    cfg = compose(["data=synthetic", "data.synthetic.people=30", "data.synthetic.docs_per_person=1",
                   "data.vocab_size=400", f"data.cache_dir={tmp_path / 'cache'}"])
    export = tmp_path / "export"
    export.mkdir()
    (export / "memlm_config.json").write_text("{}")
    (export / "tokenizer.model").write_bytes(b"")  # stands in for the run's tokenizer (not trained again)
    write_data_config(cfg, export)
    write_manifest(export)
    data = data_config(export)
    assert data.synthetic == cfg.data.synthetic and data.tokenizer == str(export / "tokenizer.model")
    eval_cfg = EvalConfig(num_fewshot=0)
    run_questions = load_task("synthetic_qa", eval_cfg, cfg.data).examples
    assert load_task("synthetic_qa", eval_cfg, data).examples == run_questions
    assert len(run_questions) == 30 * 7  # this corpus' 30 people, not the default corpus' 1000
    # No recorded corpus, or a run that did not train on one: refused, naming why.
    (export / DATA_CONFIG_NAME).unlink()
    write_manifest(export)
    assert data_config(export) is None
    with pytest.raises(ConfigError, match="memlm_data.json"):
        load_task("synthetic_qa", eval_cfg, None)
    with pytest.raises(ConfigError, match="trained on data.kind='random'"):
        load_task("synthetic_qa", eval_cfg, compose([]).data)
    (export / DATA_CONFIG_NAME).write_text('{"data": {"kind": "synthetic", "no_such_field": 1}}')
    write_manifest(export)
    with pytest.raises(ConfigError, match="memlm_data.json.*no_such_field"):
        data_config(export)


# ------------------------------------------------------------ command line
def test_cli_checks_paths_before_loading_the_model(tmp_path, monkeypatch, capsys):
    import memlm.run.load
    from memlm.evals.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(memlm.run.load, "load_model", no_load)
    export = tmp_path / "export"
    export.mkdir()
    (export / "memlm_config.json").write_text("{}")
    (tmp_path / "file").write_text("")
    cases = [
        ([f"out={tmp_path / 'r.txt'}"], "out='" + str(tmp_path / "r.txt") + "': a path ending in .json"),
        ([f"out={tmp_path / 'file' / 'r.json'}"], "whose folders are folders"),
        ([], "out='': a .json path for the results"),
        ([f"out={tmp_path / 'r.json'}", f"tokenizer={tmp_path / 'none.model'}"], "an existing sentencepiece"),
        ([f"out={tmp_path / 'r.json'}"], "has no tokenizer.model"),
    ]
    for extra, message in cases:
        assert main([f"checkpoint={export}", "tasks=[synthetic_qa]", *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra
    (export / "tokenizer.model").write_bytes(b"")
    from memlm.hf.pretrained import write_manifest

    write_manifest(export)  # checked as an export's files are
    assert main([f"checkpoint={export}", "tasks=[synthetic_qa]", f"out={tmp_path / 'r.json'}"]) == 2
    assert "memlm_data.json" in capsys.readouterr().err  # an export that records no corpus


# ------------------------------------------------------------- lm-eval adapter
def test_adapter_refuses_unknown_model_args(lm):
    pytest.importorskip("lm_eval")
    from memlm.evals.lm_eval import MemLM

    tokenizer, model = lm
    with pytest.raises(ValueError, match=r"unknown --model_args pretrained='x'.*valid: checkpoint, tokenizer"):
        MemLM(model=model, tokenizer=tokenizer, pretrained="x")
    with pytest.raises(ValueError, match="unknown --model_args dtype='float32'"):  # before any checkpoint is read
        MemLM.create_from_arg_string("checkpoint=/nowhere,dtype=float32", {"batch_size": 4, "device": "cpu"})
    adapter = MemLM.create_from_arg_obj({"model": model, "tokenizer": tokenizer},
                                        {"batch_size": 4, "max_batch_size": 64, "device": "cpu"})
    assert adapter.batch_size == 4


def test_adapter_rolling_progress_moves_per_batch(lm, monkeypatch):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from memlm.evals import lm_eval as adapter_module
    from memlm.evals.scoring import rolling_loglikelihoods

    tokenizer, model = lm
    model = make_model(max_seq_len=16)
    texts = [" ".join(r["question"] for r in QA_ROWS[k:] + QA_ROWS[:k]) for k in range(3)]
    adapter = adapter_module.MemLM(model=model, tokenizer=tokenizer, batch_size=2)
    seen: list[tuple[int | None, int]] = []

    class Bar(adapter_module.tqdm):
        def update(self, n=1):
            super().update(n)
            seen.append((self.total, self.n))

    monkeypatch.setattr(adapter_module, "tqdm", Bar)
    requests = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    scores = adapter.loglikelihood_rolling(requests)
    windows = sum(-(-len(tokenizer.encode(t)) // 16) for t in texts)
    # The total known up front, then one step per batch of windows (identical windows are
    # scored once, so a batch may count more than 2), not one step at the end.
    counts = [n for _, n in seen]
    assert windows > 6 and len(seen) >= 3 and counts == sorted(set(counts)) and counts[-1] == windows
    assert all(total == windows for total, _ in seen)
    assert scores == [lp for lp, _ in rolling_loglikelihoods(model, tokenizer, texts, 0, 2)]
