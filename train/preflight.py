"""A run's inputs, checked before anything starts: data files, tokenizer, eval task files.

    check_run_inputs(cfg)     # raises ConfigError / TaskDataError naming the file
    check_eval_inputs(cfg)    # the eval part only (the trainer, whose loader checks the data)
    check_init_from(cfg)      # what init_from points at (a checkpoint, an export or a Llama), read once

`compose` validates values; this reads what the values point at, without
tokenizing or generating a corpus, so `python -m memlm.launch local` can
refuse a bad data path or a malformed eval file with one line before
torchrun starts a rank (docs/launch.md), and the trainer can refuse it before
it touches the run folder.
"""

from __future__ import annotations

import dataclasses

from memlm.checkpoint.folder import CheckpointError, read_meta
from memlm.config.run import Config
from memlm.data.corpus import check_inputs
from memlm.errors import ConfigError
from memlm.evals.tasks import load_task
from memlm.finetune.modes import mode_of
from memlm.hf.importer import check_import_source
from memlm.hf.source import ModelSource, model_source


def check_eval_inputs(cfg: Config) -> None:
    """Evaluation during or after training has tasks, a corpus with text, and
    task files that are found and parse: not discovered after hours of training."""
    e = cfg.eval
    if not (e.after_training or e.every):
        return
    if not e.tasks:
        raise ConfigError("eval.tasks", list(e.tasks),
                          "at least one task when eval.after_training or eval.every is set")
    if cfg.data.kind == "random":
        raise ConfigError("data.kind", "random", "a corpus with a tokenizer (evaluation decodes text)")
    for name in e.tasks:
        load_task(name, e, cfg.data)


def check_init_from(cfg: Config) -> ModelSource | None:
    """An export or a Llama (hf:<dir>) must describe the run's architecture
    (every difference is named with its fix); any other `init_from` must be a
    complete memlm checkpoint (its folder, its run's dump_dir or checkpoints/latest: the newest).
    The fine-tune mode's own inputs exist (finetune=sparse: its background file)."""
    source = model_source(cfg.init_from) if cfg.init_from else None
    mode_of(cfg).check_inputs(cfg, source)
    if source is None:
        return None
    if source.kind != "checkpoint":
        return check_import_source(cfg, source)
    try:
        return dataclasses.replace(source, checked=read_meta(source.directory))
    except CheckpointError as err:
        raise ConfigError("init_from", cfg.init_from, f"a memlm checkpoint (<dump_dir>, its checkpoints/latest "
                          f"or checkpoints/step_N), a memlm export (python -m memlm.hf.export) or hf:<Llama dir>; "
                          f"{err}") from None


def check_run_inputs(cfg: Config) -> None:
    check_inputs(cfg.data)
    check_eval_inputs(cfg)
    check_init_from(cfg)
