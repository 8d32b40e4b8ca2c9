"""The README's demo figures are the record's (docs/runs/demo, launch/demo_record.py)."""

from __future__ import annotations

import json
from pathlib import Path

from memlm.launch import demo_record

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "runs" / "demo" / "runs.json"


def test_the_record_holds_seeds_0_to_2_with_the_kernel_on_and_off_and_equal_figures():
    runs = json.loads(RECORD.read_text())
    assert len({r["commit"] for r in runs}) == 1
    by = {(r["seed"], r["native"]): r for r in runs}
    assert sorted(by) == [(s, n) for s in (0, 1, 2) for n in (False, True)]
    for seed in (0, 1, 2):
        assert demo_record.same_figures(by[seed, True], by[seed, False]), f"seed {seed}: kernel on != off"


def test_readme_states_the_recorded_range_and_commit():
    runs = json.loads(RECORD.read_text())
    span = demo_record.ranges(runs)
    readme = " ".join((ROOT / "README.md").read_text().split())  # the paragraph's line breaks aside
    assert f"{demo_record.span_text(*span['trained'])} of the facts asked in a trained phrasing" in readme
    assert f"{demo_record.span_text(*span['held_out'])} asked in held-out phrasings" in readme
    assert f"commit {runs[0]['commit'][:10]}" in readme
    minutes = [round(r["seconds"] / 60, 1) for r in runs]
    assert f"in {demo_record.span_text(min(minutes), max(minutes), ' minutes')}" in readme
    assert (ROOT / "docs" / "runs" / "demo" / "README.md").read_text() and "docs/runs/demo" in readme


def run(seed, native, held_out, val_loss=0.5):
    return {"commit": "c" * 40, "seed": seed, "native": native, "trained": 0.99, "held_out": held_out,
            "final_loss": 0.2, "val_loss": val_loss, "evals": {"synthetic_qa_seen": {"exact_match": held_out}},
            "seconds": 150.0, "load_before": 1.0, "table": "----\na | b\n----"}


def test_render_says_whether_on_and_off_agree_and_gives_the_range():
    text = demo_record.render([run(0, True, 0.55), run(0, False, 0.55), run(1, True, 0.6), run(1, False, 0.6, 0.7)],
                              "cccc (msg)", "CPU X")
    assert "seed 0: equal, seed 1: DIFFERENT" in text
    assert "facts, trained phrasing 99.0%; facts, held-out phrasings 55.0-60.0%" in text
    assert text.count("```") == 8  # each run's results table, verbatim


def test_results_table_is_the_last_dashed_block():
    stdout = "[demo 4/4] x\n\n-----\nrow | 1\n-----\ntrailing\n\n------\nfacts | 50.0%\nwall time | 2 min\n------\n"
    assert demo_record.results_table(stdout) == "------\nfacts | 50.0%\nwall time | 2 min\n------"
