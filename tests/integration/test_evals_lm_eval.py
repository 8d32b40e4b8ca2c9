"""The lm-eval adapter against the native harness: the same tiny model and
local files, written once as memlm task folders and once as lm-eval YAML
tasks, must give the same accuracy (multiple choice) and the same exact match
and predictions (generation). Skipped when lm-eval is not installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from evals_fixtures import (
    CHOICE_ROWS,
    MMLU_ROWS,
    QA_ROWS,
    make_model,
    make_tokenizer,
    write_jsonl,
)

from memlm.config.eval import EvalConfig
from memlm.evals.harness import evaluate_task
from memlm.evals.tasks import load_task

lm_eval = pytest.importorskip("lm_eval")

QA_YAML = """task: memlm_parity_qa
dataset_path: json
dataset_kwargs:
  data_files: {{test: {root}/myqa/test.jsonl, train: {root}/myqa/train.jsonl}}
  cache_dir: {root}/hf_cache
test_split: test
fewshot_split: train
fewshot_config: {{sampler: first_n}}
output_type: generate_until
num_fewshot: 2
doc_to_text: "Q: {{{{question}}}}?\\nA:"
doc_to_target: answer
target_delimiter: " "
fewshot_delimiter: "\\n\\n"
generation_kwargs: {{until: ["\\n"], max_gen_toks: 16, do_sample: false}}
filter_list:
  - name: strip
    filter: [{{function: remove_whitespace}}, {{function: take_first}}]
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true, ignore_case: true,
     ignore_punctuation: true, regexes_to_ignore: ["\\\\b(?:The |the |An |A |a |an )"]}}
"""

MMLU_YAML = """task: memlm_parity_mmlu
dataset_path: json
dataset_kwargs:
  data_files: {{test: {root}/mmlu/test.jsonl, dev: {root}/mmlu/dev.jsonl}}
  cache_dir: {root}/hf_cache
test_split: test
fewshot_split: dev
fewshot_config: {{sampler: first_n}}
num_fewshot: 2
output_type: multiple_choice
description: "The following are multiple choice questions (with answers) about high school math.\\n\\n"
doc_to_text: "{{{{question.strip()}}}}\\nA. {{{{choices[0]}}}}\\nB. {{{{choices[1]}}}}\\nC. {{{{choices[2]}}}}\\nD. {{{{choices[3]}}}}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
metric_list: [{{metric: acc}}]
"""

CHOICE_YAML = """task: memlm_parity_choice
dataset_path: json
dataset_kwargs:
  data_files: {{test: {root}/mychoice/test.jsonl}}
  cache_dir: {root}/hf_cache
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    tokenizer, model = make_tokenizer(root), make_model(max_seq_len=512)
    write_jsonl(root / "myqa" / "train.jsonl", QA_ROWS[:2])
    write_jsonl(root / "myqa" / "test.jsonl", QA_ROWS[2:] * 2)
    mmlu = [{"question": q, "choices": c, "answer": "ABCD".index(a), "subject": "high_school_math"}
            for q, *c, a in MMLU_ROWS]
    write_jsonl(root / "mmlu" / "dev.jsonl", mmlu[:2])
    write_jsonl(root / "mmlu" / "test.jsonl", (mmlu * 3)[:10])
    # lm-eval's doc_to_text names one field: the question style only
    questions = [r for r in CHOICE_ROWS if "question" in r]
    write_jsonl(root / "mychoice" / "test.jsonl", questions * 3)
    cfg = EvalConfig(data_dir=str(root), num_fewshot=2, max_new_tokens=16, batch_size=4,
                     task_fewshot={"choice:mychoice": 0})
    # Gold answers from the model's own predictions for half the questions, so
    # exact match is neither 0 nor 1 and any difference in prompts or decoding shows.
    task = load_task("qa:myqa", cfg)
    _, records = evaluate_task(model, tokenizer, task, cfg)
    rows = [{"question": r["question"], "answer": [r["prediction"]] if i % 2 == 0 else ["zebra crossing"]}
            for i, r in enumerate(records)]
    assert any(r["prediction"].strip() for r in records)
    write_jsonl(root / "myqa" / "test.jsonl", rows)
    for name, text in (("qa", QA_YAML), ("mmlu", MMLU_YAML), ("choice", CHOICE_YAML)):
        (root / "tasks").mkdir(exist_ok=True)
        (root / "tasks" / f"{name}.yaml").write_text(text.format(root=root))
    return root, tokenizer, model, cfg


def test_native_and_lm_eval_agree(setup, monkeypatch):
    root, tokenizer, model, cfg = setup
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    from memlm.evals.lm_eval import MemLM

    cfg.log_samples = True  # records keep their prompts
    native, records = {}, {}
    for name in ("qa:myqa", "mmlu", "choice:mychoice"):
        metrics, records[name] = evaluate_task(model, tokenizer, load_task(name, cfg), cfg)
        native.update(metrics)
    assert 0 < native["qa:myqa"]["exact_match"] < 1

    adapter = MemLM(model=model, tokenizer=tokenizer, batch_size=4)
    out = lm_eval.simple_evaluate(
        model=adapter, tasks=["memlm_parity_qa", "memlm_parity_mmlu", "memlm_parity_choice"],
        task_manager=TaskManager(include_path=str(root / "tasks"), include_defaults=False), log_samples=True,
        bootstrap_iters=0)
    res = out["results"]
    assert res["memlm_parity_qa"]["exact_match,strip"] == pytest.approx(native["qa:myqa"]["exact_match"])
    assert res["memlm_parity_mmlu"]["acc,none"] == pytest.approx(native["mmlu"]["acc"])
    assert res["memlm_parity_choice"]["acc,none"] == pytest.approx(native["choice:mychoice"]["acc"])
    assert res["memlm_parity_choice"]["acc_norm,none"] == pytest.approx(native["choice:mychoice"]["acc_norm"])
    # Example by example: the same prompts, the same generated text, the same choice.
    for task, name in (("memlm_parity_qa", "qa:myqa"), ("memlm_parity_mmlu", "mmlu"),
                       ("memlm_parity_choice", "choice:mychoice")):
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        assert [s["arguments"][0][0] for s in samples] == [r["prompt"] for r in records[name]], task
    qa = sorted(out["samples"]["memlm_parity_qa"], key=lambda s: s["doc_id"])
    assert [s["resps"][0][0].strip() for s in qa] == [r["prediction"] for r in records["qa:myqa"]]
    mmlu = sorted(out["samples"]["memlm_parity_mmlu"], key=lambda s: s["doc_id"])
    assert [s["acc"] for s in mmlu] == [r["acc"] for r in records["mmlu"]]


def test_importing_memlm_evals_does_not_need_lm_eval():
    code = ("import sys; import memlm.evals, memlm.evals.suite, memlm.evals.cli; "
            "assert 'lm_eval' not in sys.modules, 'lm_eval imported'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_adapter_is_registered_and_rejects_sampling(setup):
    _, tokenizer, model, _ = setup
    from lm_eval.api.registry import get_model

    from memlm.evals.lm_eval import MemLM

    assert get_model("memlm") is MemLM
    with pytest.raises(ValueError, match="greedily"):
        MemLM(model=model, tokenizer=tokenizer)._generation_key({"do_sample": True, "temperature": 1.0})
    with pytest.raises(ValueError, match="checkpoint="):
        MemLM()


@pytest.mark.slow
def test_lm_eval_command_line_with_a_checkpoint(setup, tmp_path):
    """`python -m memlm.evals.lm_eval` is lm-eval's CLI with the memlm model registered."""
    from evals_fixtures import train_tiny_run

    root = setup[0]
    run = train_tiny_run(tmp_path / "run", tmp_path / "cache")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "memlm.evals.lm_eval", "--model", "memlm", "--model_args", f"checkpoint={run}",
         "--batch_size", "4", "--tasks", "memlm_parity_choice", "--include_path", str(root / "tasks"),
         "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "memlm_parity_choice" in proc.stdout and "acc_norm" in proc.stdout
    assert list((tmp_path / "out").rglob("results_*.json"))
