"""docs/finetuning.md's recipe ("A first fine-tune in minutes"): its figures are those of its
recorded run (docs/runs/recipe/record.json, written by python -m memlm.studies.finetune_recipe),
that run meets the recipe's bar, and the recipe run from scratch meets it again: with the
record's evaluations to the last digit on the machine the record was measured on (same CPU,
one thread), and the bar elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import memlm
from memlm.studies.finetune_recipe import BAR, DOC, RECORD, figures, machine, main, misses, render

ROOT = Path(memlm.__file__).parent


def test_the_docs_figures_are_the_recorded_runs_and_meet_the_bar():
    record = json.loads((ROOT / RECORD).read_text())
    assert render(record) in (ROOT / DOC).read_text()
    f = figures(record)
    assert f["new_facts"] == 120 and f["new_em"][1] >= BAR["exact_match"], f
    assert abs(f["ppl_change"]) < BAR["perplexity_change"], f
    assert misses(record) == []
    assert sum(record["seconds"].values()) < 600, record["seconds"]  # "under 10 minutes", as measured


def test_a_root_holding_a_recipe_run_is_refused(tmp_path, capsys):
    (tmp_path / "runs" / "recipe_base").mkdir(parents=True)
    assert main(["--root", str(tmp_path), "--doc", "", "--record", str(tmp_path / "r.json")]) == 2
    assert "runs/recipe_base" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_the_recipe_from_scratch_meets_the_bar_and_gives_the_recorded_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(["--root", str(tmp_path), "--doc", "", "--record", str(tmp_path / "record.json")]) == 0
    fresh = json.loads((tmp_path / "record.json").read_text())
    assert misses(fresh) == []
    recorded = json.loads((ROOT / RECORD).read_text())
    # What the arithmetic depends on: one CPU model name ("AMD EPYC") covers AVX2 and AVX512 machines.
    same = ("cpu", "cpu_capability", "cores", "omp_num_threads", "torch")
    if all(machine()[k] == recorded["machine"].get(k) for k in same):
        assert fresh["evals"] == recorded["evals"]
