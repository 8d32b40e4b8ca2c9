"""Where a run's weights come from at its start: its own checkpoint, init_from, or its initialization.

    step, tokens, nonfinite, path = restore(cfg, checkpointer, model, state, init_source, tokenizer, say)
    nothing_to_train = open_run_folder(cfg, is_main, checkpointer, step, path)

- resume (a checkpoint of the run's own, chosen by `resume`): everything,
  model, optimizer, schedule, counters, data and RNG (`state()`, the
  TrainingState to load into);
- init_from, for a run with no checkpoint of its own (with resume=auto, one
  in dump_dir wins): weights only, from a memlm checkpoint, or an export or
  hf:<dir> (a Hugging Face Llama: memlm.run.importer);
- neither: the model as initialized.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from memlm.checkpoint.checkpointer import Checkpointer, TrainingState
from memlm.config.run import Config, to_yaml
from memlm.files import atomic_write_text
from memlm.finetune.modes import mode_of
from memlm.run.importer import import_init
from memlm.run.load import keep_tokenizer
from memlm.train.summary import settings_not_recorded


def restore(cfg: Config, checkpointer: Checkpointer, model: Any, state: Callable[[], TrainingState],
            init_source: Any, tokenizer: Any, say: Callable[[str], None]) -> tuple[int, int, int, Path | None]:
    """(step, tokens, skipped non-finite steps, the checkpoint resumed from or None). `say`: print on rank 0."""
    path = checkpointer.resolve(cfg.resume)
    if path is None and cfg.init_from:
        if cfg.resume == "auto":
            say(f"[train] resume=auto: no checkpoint in {checkpointer.root}, starting from "
                f"init_from={cfg.init_from}")
        if init_source.kind != "checkpoint":
            import_init(cfg, init_source, model, tokenizer, say)
        else:
            checkpointer.load_weights(init_source.directory, model, cfg.checkpoint.verify == "checksum",
                                      fresh=mode_of(cfg).fresh_on_init, meta=init_source.checked)
            say(f"[train] initialized weights from {init_source.directory}")
        return 0, 0, 0, None
    if path is None:
        if cfg.resume == "auto":
            say(f"[train] resume=auto: no checkpoint in {checkpointer.root}, starting fresh")
        return 0, 0, 0, None
    if cfg.init_from:
        say(f"[train] resume=auto: {path} found, so init_from={cfg.init_from} is not loaded "
            "(it starts runs without a checkpoint)")
    meta = checkpointer.load(path, state())
    say(f"[train] resumed from {path} at step {meta['step']}")
    if meta["step"] >= cfg.steps:
        say(f"[train] the run already reached steps={cfg.steps}: nothing to train (a larger steps= "
            "trains it further; resume=none starts it over)")
    return meta["step"], meta["tokens"], meta.get("nonfinite_total", 0), path


def open_run_folder(cfg: Config, is_main: bool, checkpointer: Checkpointer, step: int, resumed: Path | None) -> bool:
    """Whether there is nothing to train. Everything is checked and loaded: only now does a run write
    into its folder (config.yaml, its tokenizer), so a command that failed before leaves an existing
    run's files as they were. A finished run's command run again (resumed at steps or later) trains
    and writes nothing: its folder keeps describing the run that happened (study reports read
    config.yaml); the settings of this command it does not record are named on one line."""
    dump_dir = Path(cfg.dump_dir)
    if resumed is not None and step >= cfg.steps:
        if is_main and (line := settings_not_recorded(dump_dir, to_yaml(cfg))):
            print(line, flush=True)
        return True
    if is_main:
        atomic_write_text(dump_dir / "config.yaml", to_yaml(cfg))
        keep_tokenizer(cfg, dump_dir)
    checkpointer.start_lineage(step)  # later checkpoints belong to an abandoned history
    return False
