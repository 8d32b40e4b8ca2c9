"""memlm.config: the run configuration, composed in one place.

    from memlm.config.run import compose
    cfg = compose(["model=tiny", "memory=memplus", "steps=100"])  # validated dataclasses

`run.py` holds the typed `Config` (optimizer, parallel, logging, checkpoint
sections and the top-level keys) and `compose()`, which merges `configs/`
with Hydra overrides; `keys.py` names an unknown key with its closest match.
Each package keeps its own section next to its code: `model/args.py`,
`memory/config.py`, `data/config.py`, `evals/config.py` (with the task
table it validates against, `evals/registry.py`).

Imports: model, memory, data and those two evals modules (leaves that import
nothing of memlm but `errors`). Composing reads no files but configs/: what
the values point at is checked by memlm.train.preflight.
"""
