"""memlm.config: the run configuration, composed in one place.

    from memlm.config.run import compose
    cfg = compose(["model=tiny", "memory=memplus", "steps=100"])  # validated dataclasses

`run.py` holds the typed `Config` (optimizer, parallel, logging, checkpoint
sections and the top-level keys) and `compose()`, which merges `configs/`
with Hydra overrides; `keys.py` names an unknown key with its closest match.
The packages below this one keep their own section next to their code:
`model/args.py`, `memory/config.py`, `data/config.py`, `finetune/config.py`.
The harness sits above config/, so its section is here: `eval.py` (the
`eval` section) and `eval_tasks.py` (the task table it validates against,
which the harness reads too).

Imports: model, memory, data, finetune. Composing reads no files but
configs/: what the values point at is checked by memlm.train.preflight.
"""
