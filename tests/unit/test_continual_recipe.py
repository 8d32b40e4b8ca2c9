"""configs/experiment/continual_recipe.yaml is the setting the continual study measured best at 1M slots
(docs/finetuning.md's recipe): its run record's config, and the report's pick for values-only there."""

from __future__ import annotations

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
