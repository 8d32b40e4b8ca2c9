"""A run's inputs, checked before anything starts: data files, tokenizer, eval task files, W&B login.

    check_run_inputs(cfg)     # raises ConfigError / TaskDataError naming the file
    check_eval_inputs(cfg)    # the eval part only (the trainer, whose loader checks the data)
    check_init_from(cfg)      # what init_from points at (a checkpoint, an export or a Llama), read once
    check_wandb_login(cfg)    # logging.wandb.mode=online has credentials to log in with

`compose` validates values; this reads what the values point at, without
tokenizing or generating a corpus, so `python -m memlm.launch local` can
refuse a bad data path or a malformed eval file with one line before
torchrun starts a rank (docs/launch.md), and the trainer can refuse it before
it touches the run folder.
"""

from __future__ import annotations

import dataclasses

from memlm.checkpoint.folder import CheckpointError, read_meta
from memlm.config.run import Config, from_yaml
from memlm.data.corpus import check_inputs
from memlm.errors import ConfigError
from memlm.evals.tasks import load_task
from memlm.finetune.modes import mode_of
from memlm.run.importer import FREE_MEMORY, architecture, check_import_source
from memlm.run.importer import _show as override_text
from memlm.run.source import ModelSource, model_source


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
        meta = read_meta(source.directory)
    except CheckpointError as err:
        raise ConfigError("init_from", cfg.init_from, f"a memlm checkpoint (<dump_dir>, its checkpoints/latest "
                          f"or checkpoints/step_N), a memlm export (python -m memlm.hf.export) or hf:<Llama dir>; "
                          f"{err}") from None
    check_checkpoint_architecture(cfg, source.directory, meta)
    return dataclasses.replace(source, checked=meta)


def check_checkpoint_architecture(cfg: Config, directory, meta: dict) -> None:
    """init_from=<checkpoint>: the run's model.* and memory.* build the model the checkpoint saved
    (its config, in meta.json). A difference is refused before the run folder is made, with every
    difference named and the overrides that take the checkpoint's architecture; the training knn
    and eval_knn (no tensors) may differ alone."""
    try:
        saved = from_yaml(meta["config"])
    except (ConfigError, ValueError):  # a config this memlm no longer validates: the load's shape check decides
        return
    ours, theirs = architecture(cfg.model, cfg.memory), architecture(saved.model, saved.memory)
    diffs = [(key, ours.get(key), value) for key, value in theirs.items() if ours.get(key) != value]
    if all(key in FREE_MEMORY for key, _, _ in diffs):
        return  # none, or only lookup widths; when refusing, they are named too (the run's may not fit the table)
    listed = "; ".join(f"{key}={override_text(run) if run is not None else '(none)'} but the checkpoint's is "
                       f"{override_text(its)}" for key, run, its in diffs)
    fix = " ".join(f"{key}={override_text(its)}" for key, _, its in diffs)
    raise ConfigError("init_from", cfg.init_from, f"a checkpoint of the run's model: init_from loads weights only, "
                      f"and the run's model.*/memory.* differ from {directory}'s in {len(diffs)} value(s): {listed}. "
                      f"Run with the checkpoint's values: {fix}")


def check_wandb_login(cfg: Config) -> None:
    """logging.wandb.mode=online needs W&B credentials on this machine (WANDB_API_KEY, `wandb login`'s
    netrc entry): without them wandb.init would fail (or prompt) after the run folder is made."""
    if cfg.logging.wandb.mode != "online":
        return
    from wandb import env
    from wandb.errors import AuthenticationError
    from wandb.sdk.lib.wbauth.authenticate import authenticate_session

    host = env.get_base_url() or "https://api.wandb.ai"
    fix = "offline (sync later with `wandb sync`) or disabled, or online after `wandb login` or with WANDB_API_KEY set"
    try:  # what wandb.init reads first: the environment, netrc, its settings; no prompt, no network
        found = authenticate_session(host=host, source="memlm", prompt=False, update_session=False)
    except AuthenticationError as err:
        raise ConfigError("logging.wandb.mode", "online", f"{fix}: the credentials found are invalid ({err})") from None
    if found is None:
        raise ConfigError("logging.wandb.mode", "online", f"{fix}: no W&B API key is configured for {host}")


def check_trainer_inputs(cfg: Config) -> ModelSource | None:
    """The trainer's checks (its loaders check the data as they are built): the eval files, the W&B
    login (wandb.init comes after the run folder is made), and what init_from names, returned."""
    check_eval_inputs(cfg)
    check_wandb_login(cfg)
    return check_init_from(cfg)


def check_run_inputs(cfg: Config) -> None:
    check_inputs(cfg.data)
    check_eval_inputs(cfg)
    check_wandb_login(cfg)
    check_init_from(cfg)
