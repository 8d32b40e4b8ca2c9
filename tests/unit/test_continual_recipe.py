"""configs/experiment/continual_recipe.yaml is the setting the continual study measured best at 1M slots
(docs/finetuning.md's recipe): its run record's config, and the report's pick for values-only there."""

from __future__ import annotations

import json
from pathlib import Path

from memlm.config.run import compose, from_yaml
from memlm.studies import continual_report

RECORDS = Path(__file__).resolve().parents[2] / "docs" / "runs" / "continual"


def test_the_recipe_is_the_record_it_cites_and_the_studys_pick():
    ran = from_yaml((RECORDS / "k1024_s0_memory_value_lr300" / "config.yaml").read_text())
    recipe = compose(["experiment=continual_recipe"])
    assert (recipe.finetune, recipe.memory, recipe.optim, recipe.data, recipe.steps) == (
        ran.finetune, ran.memory, ran.optim, ran.data, ran.steps)
    _, sweep, _ = continual_report.load_study(RECORDS)
    best = continual_report.by_table_size(sweep)[recipe.memory.n_keys ** 2]
    chosen = min((m for mode, m in best.items() if mode != "full"), key=lambda m: m["lost"])
    assert chosen["setting"] == "sgd lr 300" and best["memory"] is chosen


def test_the_recipes_figures_in_docs_are_its_records():
    """docs/finetuning.md's sentence on what the recipe learned and lost: each figure from the record it cites
    and its base's, rounded as printed."""
    base = json.loads((RECORDS / "k1024_base_s0" / "summary.json").read_text())["evals"]
    ran = json.loads((RECORDS / "k1024_s0_memory_value_lr300" / "summary.json").read_text())["evals"]
    lost = base["bits:facts_a"]["stored_bits"] - ran["bits:facts_a"]["stored_bits"]
    ppl, base_ppl = ran["ppl:bio_heldout"]["token_ppl"], base["ppl:bio_heldout"]["token_ppl"]
    expected = (f"It learns {ran['bits:facts_b']['exact_match']:.1%} of the new facts exactly "
                f"({ran['bits:facts_b']['stored_bits']:,.0f} bits) and loses {lost:,.0f} of the base's "
                f"{base['bits:facts_a']['stored_bits']:,.0f} bits of the old facts, with held-out perplexity "
                f"{ppl:.2f} against the base's {base_ppl:.2f} ({ppl / base_ppl - 1:+.1%}) and held-out QA "
                f"{ran['qa:bio_qa']['exact_match']:.1%} against {base['qa:bio_qa']['exact_match']:.1%}.")
    doc = " ".join((RECORDS.parents[2] / "docs" / "finetuning.md").read_text().split())
    assert expected in doc
