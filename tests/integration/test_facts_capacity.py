"""The random-facts corpus (memlm.data.facts) and the knowledge-capacity metric (task facts_bits)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
from cli import run_main

from memlm.data import facts
from memlm.errors import ConfigError
from memlm.evals.metrics import stored_bits

TINY_FACTS = ["data.kind=facts", "data.facts.entities=4", "data.facts.attributes=2", "data.facts.values=16",
              "data.seq_len=32", "data.micro_batch=8", "logging.wandb.mode=disabled"]


def test_corpus_is_reproducible_and_holds_n_a_log2v_bits(tmp_path):
    a = facts.write_corpus(str(tmp_path / "a"), entities=50, attributes=3, values=8, seed=1)
    b = facts.write_corpus(str(tmp_path / "b"), entities=50, attributes=3, values=8, seed=1)
    c = facts.write_corpus(str(tmp_path / "c"), entities=50, attributes=3, values=8, seed=2)
    for name in ("train", "facts"):
        assert open(a[name], "rb").read() == open(b[name], "rb").read()
    assert open(a["facts"], "rb").read() != open(c["facts"], "rb").read()
    rows = [json.loads(line) for line in open(a["facts"])]
    docs = [json.loads(line)["text"] for line in open(a["train"])]
    assert len(rows) == len(docs) == 150
    assert len({r["entity"] for r in rows}) == 50  # unique names: no fact is ambiguous
    # Every fact is one training document, in the question's own layout.
    assert sorted(docs) == sorted(f"{r['question']} {r['answer']}" for r in rows)
    assert facts.capacity_bits(len(rows), 8) == 150 * 3


def test_values_are_uniform_over_v_candidates_per_attribute():
    rows = facts.generate(entities=4000, attributes=2, values=8, seed=0)
    for attribute in ("metal", "color"):
        counts = Counter(r["answer"] for r in rows if r["attribute"] == attribute)
        assert len(counts) == 8
        # 4000 draws over 8 values: 500 expected each, sd ~21; 5 sd either side.
        assert all(395 < n < 605 for n in counts.values()), counts


@pytest.mark.parametrize("key, value, valid", [
    ("data.facts.values", 1, "[2,"), ("data.facts.attributes", 17, "[1, 16]"), ("data.facts.entities", 0, "[1,"),
])
def test_bad_sizes_name_the_key_and_the_valid_range(key, value, valid):
    from memlm.config.run import compose

    with pytest.raises(ConfigError, match=rf"{re.escape(key)}={value}.*{re.escape(valid)}"):
        compose(["data.kind=facts", f"{key}={value}"])


def test_stored_bits_is_the_entropy_less_the_cross_entropy_floored_at_zero():
    assert stored_bits(0.0, 16) == 4.0
    assert stored_bits(1.5, 16) == 2.5
    assert stored_bits(9.0, 16) == 0.0  # worse than a guess among the candidates stores nothing


def _suite(model, cfg):
    from memlm.data.corpus import materialize_facts
    from memlm.data.tokenizer import Tokenizer
    from memlm.evals import run_suite

    tok = Tokenizer(materialize_facts(cfg.data)["tokenizer"])
    return run_suite(model, tok, cfg.eval, 0, None, data_cfg=cfg.data)["facts_bits"]


def test_an_untrained_model_stores_about_zero_bits(tmp_path):
    from conftest import compose_and_build

    model, cfg = compose_and_build([*TINY_FACTS, f"data.cache_dir={tmp_path}", "eval.tasks=[facts_bits]"])
    result = _suite(model.eval(), cfg)
    assert result["n"] == 8 and result["corpus_bits"] == 8 * math.log2(16)
    assert 0.0 <= result["stored_bits"] < 0.05 * result["corpus_bits"]
    assert result["exact_match"] == 0.0
    counts = model.num_params()
    assert result["params"] == counts["total"] and result["active_params"] == counts["active"]
    assert result["bits_per_param"] == result["stored_bits"] / counts["total"]


def test_a_model_overfit_on_a_handful_of_facts_stores_about_log2v_bits_each(tmp_path):
    """Through the CLI and eval.after_training, as a study runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    out = subprocess.run(
        [sys.executable, "-m", "memlm.train", *TINY_FACTS, f"data.cache_dir={tmp_path / 'cache'}",
         "steps=150", "optim.lr=1e-2", "optim.warmup=10", "logging.every=50", f"dump_dir={tmp_path / 'run'}",
         "eval.after_training=true", "eval.tasks=[facts_bits]"],
        capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "evals" / "150.json").read_text())["results"]["facts_bits"]
    assert result["corpus_bits"] == 8 * 4.0
    assert 0.9 * result["corpus_bits"] <= result["stored_bits"] <= result["corpus_bits"]
    assert result["exact_match"] == 1.0


def test_bits_of_a_facts_folder_equal_facts_bits_of_the_run_corpus(tmp_path):
    """`bits:<folder>` scores any facts file (a fine-tune's old and new facts): on
    a copy of the run's own facts.jsonl it is facts_bits, record for record."""
    from conftest import compose_and_build

    from memlm.data.corpus import materialize_facts
    from memlm.data.tokenizer import Tokenizer
    from memlm.evals import run_suite

    model, cfg = compose_and_build([*TINY_FACTS, f"data.cache_dir={tmp_path}", "eval.tasks=[facts_bits,bits:old]",
                                    f"eval.data_dir={tmp_path / 'evals'}"])
    paths = materialize_facts(cfg.data)
    (tmp_path / "evals" / "old").mkdir(parents=True)
    (tmp_path / "evals" / "old" / "facts.jsonl").write_text(open(paths["facts"]).read())
    results = run_suite(model.eval(), Tokenizer(paths["tokenizer"]), cfg.eval, 0, None, data_cfg=cfg.data)
    assert results["bits:old"]["n"] == 8 and results["bits:old"]["ce_bits"] > 0
    for key in ("stored_bits", "corpus_bits", "exact_match", "ce_bits", "n"):
        assert results["bits:old"][key] == results["facts_bits"][key], key
    (tmp_path / "evals" / "old" / "facts.jsonl").write_text('{"question": "Q: x?\\nA:", "answer": "y"}\n')
    from memlm.evals.formats import TaskDataError
    from memlm.evals.tasks import load_task

    with pytest.raises(TaskDataError, match=r"facts.jsonl:1.*values"):
        load_task("bits:old", cfg.eval, cfg.data)


def test_facts_bits_on_a_run_of_another_corpus_names_the_data_kind():
    from memlm.config.run import compose
    from memlm.evals.tasks import load_task

    cfg = compose(["data=synthetic", "eval.tasks=[facts_bits]"])
    with pytest.raises(ConfigError, match="data.kind=facts.*'synthetic'"):
        load_task("facts_bits", cfg.eval, cfg.data)


def test_a_run_that_could_not_evaluate_its_tasks_stops_before_training(tmp_path, capsys):
    out = run_main("memlm.train", "data=synthetic", "data.synthetic.people=20", f"data.cache_dir={tmp_path / 'cache'}",
                   "steps=2", "logging.wandb.mode=disabled", f"dump_dir={tmp_path / 'run'}",
                   "eval.after_training=true", "eval.tasks=[facts_bits]", capsys=capsys)
    assert out.returncode != 0
    assert "eval.tasks='facts_bits'" in out.stderr and "data.kind=facts" in out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained
