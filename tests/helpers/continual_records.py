"""Fabricated continual-study run records for the report's tests (tests/unit/test_studies_continual_*.py):

    record(root, "s0_full_lr1e-3", ["finetune=full", "optim.lr=1e-3"], a_bits=40.0, b=(0.99,))

writes a run folder as the study driver does (config.yaml, summary.json with the evaluations, command.txt):
facts A's bits stored out of 1,000, facts B's exact match `b[0]` with as large a share of its 200 bits.
"""

from __future__ import annotations

import json

from memlm.config.run import compose, to_yaml


def bits(stored, corpus, em):
    return {"stored_bits": stored, "corpus_bits": corpus, "exact_match": em}


def record(root, name, overrides, a_bits, b=None, rounds=None, seed=0, ppl=9.0, qa=0.1):
    cfg = compose(["experiment=continual_finetune" if b or rounds else "experiment=continual_base",
                   f"seed={seed}", *overrides])
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(to_yaml(cfg))
    evals = {"bits:facts_a": bits(a_bits, 1000.0, a_bits / 1000), "ppl:bio_heldout": {"token_ppl": ppl},
             "qa:bio_qa": {"exact_match": qa}}
    if b:
        evals["bits:facts_b"] = bits(b[0] * 200, 200.0, b[0])
    for r, (stored, em) in (rounds or {}).items():
        evals[f"bits:facts_b{r}"] = bits(stored, 100.0, em)
    (folder / "summary.json").write_text(json.dumps({"steps": 300, "evals": evals}))
    (folder / "command.txt").write_text(f"OMP_NUM_THREADS=1 python -m memlm.train {' '.join(overrides)}\n")


SPARSE = ["finetune=sparse", "finetune.optimizer=sgd"]
MEMORY = ["finetune=memory", "finetune.optimizer=sgd"]
