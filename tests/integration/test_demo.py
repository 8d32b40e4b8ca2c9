"""The README demo end to end (shortened), and evaluation after training from the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _run(args, cwd):
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, env=env,
                          timeout=900)


@pytest.mark.slow
def test_demo_runs_every_stage_and_prints_the_results_table(tmp_path):
    out = _run(["memlm.launch.demo", "steps=40", "checkpoint.every=20", "val_every=20", "logging.every=10",
                "eval.limit=20", "data.synthetic.people=60"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    for stage in range(1, 5):
        assert f"[demo {stage}/4]" in out.stdout
    for label in ("facts, trained phrasing", "facts, held-out phrasings"):
        assert f"{label}: exact_match (n=20)" in out.stdout
    assert "wandb" not in out.stdout + out.stderr and "{'name'" not in out.stdout  # progress and the table only
    assert "validation perplexity" in out.stdout
    run = tmp_path / "runs" / "demo"
    results = json.loads((run / "evals" / "40.json").read_text())["results"]
    assert set(results) == {"synthetic_qa_trained", "synthetic_qa_seen"}
    assert results["synthetic_qa_seen"]["n"] == 20
    assert (tmp_path / "exports" / "demo" / "model.safetensors").is_file()
    assert (run / "checkpoints" / "step_00000040" / "meta.json").is_file()


@pytest.mark.slow
def test_train_with_eval_after_training_writes_every_task(tmp_path):
    out = _run(["memlm.train", "data=synthetic", "data.synthetic.people=40", f"data.cache_dir={tmp_path / 'c'}",
                "data.seq_len=32", "steps=4", "logging.wandb.mode=disabled", f"dump_dir={tmp_path / 'run'}",
                "eval.after_training=true", "eval.tasks=[synthetic_qa]", "eval.limit=8", "eval.num_fewshot=2"],
               tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "evals" / "4.json").read_text())
    assert set(report["results"]) == {"synthetic_qa"}
    assert report["results"]["synthetic_qa"]["n"] == 8
