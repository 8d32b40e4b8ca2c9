"""Where an Engram model keeps a fact (memlm.studies.engram_where), on a tiny model overfit on a few facts."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from memlm.config.run import compose
from memlm.studies import engram_where

RUN = ["data.kind=facts", "data.facts.entities=4", "data.facts.attributes=2", "data.facts.values=16", "data.seq_len=32",
       "data.micro_batch=8", "memory=engram", "memory.engram.layers=[0]", "memory.engram.heads=2",
       "memory.engram.head_dim=8", "memory.engram.rows_per_head=50", "memory.value_lr=1e-2", "optim.lr=1e-2",
       "optim.warmup=10", "steps=150", "logging.every=50", "eval.after_training=true", "eval.tasks=[facts_bits]"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from memlm.data.corpus import materialize_facts
    from memlm.data.tokenizer import Tokenizer
    from memlm.train.trainer import Trainer

    tmp = tmp_path_factory.mktemp("where")
    cfg = compose([*RUN, f"data.cache_dir={tmp / 'cache'}", f"dump_dir={tmp / 'run'}"])
    trainer = Trainer(cfg)
    trainer.fit()
    paths = materialize_facts(cfg.data)
    facts = [json.loads(line) for line in open(paths["facts"])]
    result = json.loads((tmp / "run" / "evals" / "150.json").read_text())["results"]["facts_bits"]
    return trainer.model.eval(), Tokenizer(paths["tokenizer"]), facts, result


def test_the_entity_span_is_the_entitys_tokens(trained):
    _, tok, facts, _ = trained
    for fact in facts:
        span = engram_where.entity_span(tok, fact["question"], fact["entity"])
        row = [tok.eos_id, *tok.encode(fact["question"])]
        assert tok.decode(row[span[0]:span[1]]).strip() == fact["entity"]


def test_nothing_masked_scores_as_the_bits_evaluation(trained):
    model, tok, facts, result = trained
    got = engram_where.where(model, tok, facts)
    assert got["all"]["n"] == len(facts) == result["n"] and got["all"]["skipped"] == 0
    assert got["all"]["stored_bits"] == pytest.approx(result["stored_bits"], rel=1e-6)
    assert got["all"]["exact_match"] == result["exact_match"]


def test_all_masked_equals_the_model_whose_engram_adds_nothing(trained):
    """An independent reference: Engram's value projection zeroed makes its output 0 everywhere."""
    model, tok, facts, _ = trained
    without = copy.deepcopy(model)
    for block in without.layers:
        if block.engram is not None:
            torch.nn.init.zeros_(block.engram.w_v.weight)
    masked = engram_where.where(model, tok, facts)["none"]
    reference = engram_where.where(without, tok, facts)["all"]
    assert masked == reference
    assert not engram_where.where(model, tok, facts)["all"] == masked  # Engram mattered to what it learned


def test_a_model_without_engram_is_refused(trained):
    from memlm.errors import ConfigError
    from memlm.model import build_model

    _, tok, facts, _ = trained
    cfg = compose(["model.vocab_size=512"])
    with pytest.raises(ConfigError):
        engram_where.where(build_model(cfg.model, seed=0).eval(), tok, facts)


def test_each_condition_keeps_the_positions_it_names():
    keep = {c: engram_where._keep(c, 10, (3, 5), max_order=3).flatten().tolist() for c in engram_where.CONDITIONS}
    assert keep["entity_only"] == [0, 0, 0, 1, 1, 0, 0, 0, 0, 0]
    assert keep["without_entity"] == [1, 1, 1, 0, 0, 1, 1, 1, 1, 1]
    assert keep["after_entity"] == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert keep["spanning_ngrams"] == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0]  # n-grams of order <= 3 reach 2 back
    assert keep["past_spanning"] == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert keep["all"] == [1] * 10 and keep["none"] == [0] * 10
