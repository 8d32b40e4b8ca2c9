"""Evaluation during training runs on the live sharded model: on 2 gloo ranks
(FSDP, and the value table split by columns over the ranks) it gives the
numbers of one process evaluating the saved checkpoint, and holds no second
copy of the model."""

from __future__ import annotations

import json

import pytest
from distributed_workers import run_ranks
from eval_live_workers import fit_measuring_eval
from evals_fixtures import CHOICE_ROWS, MMLU_ROWS, QA_ROWS, write_jsonl, write_mmlu_csv

from memlm.evals.cli import main as eval_main

TASKS = "[synthetic_qa,nq_open,mmlu,hellaswag,ppl]"  # greedy decoding, and scoring of choices and windows


def _data_dir(root):
    write_jsonl(root / "nq_open" / "test.jsonl", QA_ROWS)
    write_jsonl(root / "nq_open" / "train.jsonl", QA_ROWS)
    write_mmlu_csv(root, {"math": MMLU_ROWS[:3], "biology": MMLU_ROWS[1:]}, "test")
    write_mmlu_csv(root, {"math": MMLU_ROWS[:2], "biology": MMLU_ROWS[:2]}, "dev")
    write_jsonl(root / "hellaswag" / "test.jsonl", CHOICE_ROWS)
    # Documents of different lengths: the ranks score different numbers of windows.
    write_jsonl(root / "ppl" / "test.jsonl", [{"text": "Ada Lovelace was born in London. " * n} for n in (1, 9, 3)])
    return root


@pytest.mark.slow
def test_eval_during_training_on_two_ranks_matches_one_process_and_loads_no_second_model(tmp_path):
    run = tmp_path / "run"
    overrides = [
        "model.vocab_size=512", "model.max_seq_len=128", "data=synthetic", "data.synthetic.people=40",
        f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32", "data.micro_batch=2",
        "memory=memplus", "memory.layers=[1]", "memory.n_keys=128", "memory.knn=8", "parallel.memory_parallel=2",
        "steps=4", "eval.every=2", "eval.after_training=true", f"eval.tasks={TASKS}",
        f"eval.data_dir={_data_dir(tmp_path / 'data')}",
        "eval.limit=5", "eval.num_fewshot=1", "eval.max_new_tokens=6", "eval.batch_size=2", "eval.ppl_stride=24",
        "eval.log_samples=true", "logging.wandb.mode=disabled", f"dump_dir={run}",
    ]
    run_ranks(fit_measuring_eval, 2, overrides, str(tmp_path))
    live = json.loads((run / "evals" / "4.json").read_text())
    assert live["world_size"] == 2 and (run / "evals" / "2.json").is_file()

    # The reference: one process evaluates the saved step-4 checkpoint, loaded whole.
    out = tmp_path / "one.json"
    assert eval_main([f"checkpoint={run}/checkpoints/step_00000004", f"data_dir={tmp_path / 'data'}",
                      f"tasks={TASKS}", "limit=5", "num_fewshot=1", "max_new_tokens=6", "batch_size=2",
                      "ppl_stride=24", "log_samples=true", f"out={out}"]) == 0
    one = json.loads(out.read_text())
    def samples(path, task, key):
        return [r[key] for r in map(json.loads, path.read_text().splitlines()) if r["task"] == task]

    live_samples, one_samples = run / "evals" / "4_samples.jsonl", tmp_path / "one_samples.jsonl"
    for task in ("synthetic_qa", "nq_open"):
        assert live["results"][task] == one["results"][task]
        assert samples(live_samples, task, "prediction") == samples(one_samples, task, "prediction")
    for task in ("mmlu", "hellaswag"):  # every choice's log-likelihood, example by example
        assert live["results"][task]["acc"] == one["results"][task]["acc"]
        live_lp, one_lp = samples(live_samples, task, "logprobs"), samples(one_samples, task, "logprobs")
        assert len(live_lp) == len(one_lp) == one["results"][task]["n"]
        for a, b in zip(live_lp, one_lp):
            assert a == pytest.approx(b, rel=1e-5)
    assert live["results"]["ppl"]["tokens"] == one["results"]["ppl"]["tokens"]
    assert live["results"]["ppl"]["token_ppl"] == pytest.approx(one["results"]["ppl"]["token_ppl"], rel=1e-5)

    # Memory: while it evaluates, a rank holds no second copy of the model (the
    # old path loaded the whole checkpoint, fp32, beside the sharded state).
    for rank in (0, 1):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(measured["rises"]) == 2 and measured["samples"] > 20  # step 2 and after training
        assert max(measured["rises"]) < measured["model_bytes"] / 2, measured
