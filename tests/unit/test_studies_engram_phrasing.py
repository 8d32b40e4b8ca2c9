"""The Engram phrasing rows (memlm.studies.engram_phrasing) on small fabricated run folders."""

from __future__ import annotations

import json

import pytest

from memlm.config.run import compose, to_yaml
from memlm.studies import engram_phrasing as report
from memlm.studies.ablation_report import write_doc

ENV = {"commit": "0123456789abcdef", "torch": "2.13.0+cpu", "cpu": "AMD EPYC"}


def _run(root, name, experiment, seen, trained, unseen=0.1, evals=True, env=ENV):
    """A finished ablation run folder: its config, summary and one evaluation file."""
    dump = root / name
    (dump / "evals").mkdir(parents=True)
    (dump / "config.yaml").write_text(to_yaml(compose([f"experiment={experiment}"])))
    (dump / "summary.json").write_text(json.dumps({"steps": 3000, "val_loss": 0.7, "seconds": 1200,
                                                   "environment": env}))
    results = {"synthetic_qa_seen": {"exact_match": seen, "phrasings_em50": 0.25},
               "synthetic_qa_unseen": {"exact_match": unseen}, "synthetic_qa_trained": {"exact_match": trained}}
    if evals:
        (dump / "evals" / "step_3000.json").write_text(json.dumps({"step": 3000, "results": results}))


def test_each_variant_is_set_against_memplus_of_the_same_records(tmp_path):
    _run(tmp_path, "ablation_memplus", "ablation_memplus", seen=0.30, trained=0.50)
    _run(tmp_path, "ablation_engram", "ablation_engram", seen=0.40, trained=0.75, unseen=0.05)
    _run(tmp_path, "ablation_engram_memplus", "ablation_engram_memplus", seen=0.35, trained=0.60,
         env={**ENV, "cpu_capability": "AVX2"})
    rows = report.load_records(tmp_path)
    assert [(r["run"], r["variant"]) for r in rows] == [
        ("ablation_engram", "Engram"), ("ablation_engram_memplus", "Engram 25% + Memory+"),
        ("ablation_memplus", "Memory+")]
    # The configs' own comments: 607,232 and 637,568 against Memory+'s 627,200 active FLOPs per token.
    assert [r["flops"] for r in rows] == [607_232, 637_568, 627_200]
    text = report.render(rows)
    assert "| ablation_engram | Engram | 0 | 0123456, torch 2.13.0+cpu, AMD EPYC | 607,232 | 3,000 | 0.7000 " \
           "| 40.0% | 25.0% | 5.0% | 75.0% | 20 |" in text
    assert ("- Engram (seed 0) against Memory+ (seed 0) at 0.968x its active FLOPs/token: held-out phrasings "
            "+10.0 points (40.0% vs 30.0%), trained phrasings +25.0 points (75.0% vs 50.0%), biography only "
            "-5.0 points.") in text
    assert "- Engram 25% + Memory+ (seed 0) against Memory+ (seed 0) at 1.017x" in text
    assert "| ablation_engram_memplus | Engram 25% + Memory+ | 0 | 0123456, torch 2.13.0+cpu, AMD EPYC (AVX2) |" in text

    doc = tmp_path / "results.md"
    doc.write_text(f"before\n{report.BEGIN}\nold\n{report.END}\nafter\n")
    write_doc(doc, text, report.BEGIN, report.END)
    assert doc.read_text() == f"before\n{text}\nafter\n"


def test_a_folder_without_the_held_out_evaluation_is_refused(tmp_path):
    _run(tmp_path, "ablation_engram", "ablation_engram", seen=0.4, trained=0.7, evals=False)
    with pytest.raises(report.PhrasingError, match="no synthetic_qa_seen/exact_match"):
        report.load_records(tmp_path)
