"""The README demo end to end (shortened), and evaluation after training from the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _run(args, cwd, **env):
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, env=env,
                          timeout=900)


SHORT_DEMO = ["memlm.launch.demo", "steps=40", "checkpoint.every=20", "val_every=20", "logging.every=10",
              "eval.limit=20", "data.synthetic.people=60"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The short demo with the native top-k kernel (MEMLM_NATIVE_TOPK=1): its folder and output."""
    cwd = tmp_path_factory.mktemp("demo_native")
    return cwd, _run(SHORT_DEMO, cwd, MEMLM_NATIVE_TOPK="1")


def _figures(run):
    """Every number a demo run reports: summary (losses, evals) and each metrics.jsonl loss."""
    summary = json.loads((run / "summary.json").read_text())
    losses = [(r["step"], r.get("loss"), r.get("val_loss")) for r in map(json.loads, open(run / "metrics.jsonl"))]
    return {key: summary[key] for key in ("final_loss", "val_loss", "evals", "tokens")}, losses


@pytest.mark.slow
def test_demo_runs_every_stage_and_prints_the_results_table(demo):
    tmp_path, out = demo
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
def test_demo_figures_are_equal_with_the_native_top_k_off(demo, tmp_path):
    # The kernel returns torch.topk's slots, so a machine without a C
    # compiler (torch.topk) trains and scores the same model: the whole path
    # here. Ties are rare in training (22 of 1.3M top-k rows in 200 demo
    # steps); their rule is tested in tests/unit/test_memory_native_topk.py.
    native_dir, native = demo
    assert native.returncode == 0 and "native top-k kernel is unavailable" not in native.stderr
    out = _run(SHORT_DEMO, tmp_path, MEMLM_NATIVE_TOPK="0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert _figures(tmp_path / "runs" / "demo") == _figures(native_dir / "runs" / "demo")


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
