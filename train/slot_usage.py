"""Write a background for sparse fine-tuning: how often a corpus reads each memory slot
(finetune=sparse; memlm.finetune.background; docs/finetuning.md).

    python -m memlm.train.slot_usage runs/base --batches 64                 # beside its newest checkpoint
    python -m memlm.train.slot_usage runs/base data.facts.entities=1000     # another sample of its data
    python -m memlm.train.slot_usage hf:/models/llama --out bg.safetensors <the fine-tune's overrides>
    python -m memlm.train.slot_usage exports/base --out bg.safetensors <the fine-tune's overrides>

The model is any a run can start from (memlm.run.source):
- a memlm checkpoint (its folder, its run's dump_dir or checkpoints/latest):
  the checkpoint's model over its run's data; key=value overrides change the
  saved config's data (data.*, seed); a model, memory or fine-tune key, which
  the saved model would ignore, is refused. Written beside the checkpoint,
  where a fine-tune with init_from=<that checkpoint> finds it.
- an export or `hf:<Llama dir>`: the model a run with these overrides and
  `init_from=<it>` starts from, built and initialized as the trainer does (a
  retrofit's fresh memory layers included: the same seed, the same weights),
  over the corpus the overrides name (an export's own data by default; a
  Llama records none, so `data=...` is needed). `--out` names the file; the
  fine-tune reads it with `finetune.background=<file>`.

Runs the model in training mode (the training knn, as a fine-tuning step
reads) without gradients over `--batches` batches, counts every read of every
memory layer and writes `slot_usage.safetensors`: one int64 (n_slots,) tensor
per layer ("layer4"), and per value table one of how many of the batches read
each slot ("batches_read:layer4", finetune.ranking=tfidf_batches's background;
a batch is data.micro_batch rows), with the tokens counted, the batches, their
tokens each and the source in its metadata.
Then prints how many slots the sample read and how concentrated the reads are.
An existing file there is replaced only with `--overwrite`, and only when it is
an earlier slot-usage file (anything else is refused with one line, before the
count): beside a checkpoint, the file may be the background its training
recorded over its last steps, which nothing but that training writes again.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from memlm.config.keys import unknown_key_error
from memlm.config.run import GROUPS, Config, compose
from memlm.distributed.env import seed_everything
from memlm.distributed.memory_hooks import init_value_tables
from memlm.errors import ConfigError, entry_point
from memlm.files import check_output_file
from memlm.finetune.background import (
    FILE,
    collect,
    describe,
    describe_batch_reads,
    is_usage_file,
    memory_layers,
    save_usage,
    value_tables,
)
from memlm.memory.schedule import apply_knn_schedule
from memlm.model import Transformer
from memlm.run.importer import check_import_source, import_init
from memlm.run.load import data_config, load_model
from memlm.run.source import ModelSource, model_source
from memlm.train.data_source import build_train_loader

ONE_PROCESS = argparse.Namespace(rank=0, world_size=1)


def start_model(cfg: Config, source: ModelSource, tokenizer, log=lambda line: None) -> Transformer:
    """The weights a one-process run of `cfg` starts from when `cfg.init_from` is an export or a
    Llama (`source`, as check_import_source returned it; the trainer's order: seeded init, value
    tables from the seed, then the import)."""
    seed_everything(cfg.seed)
    model = Transformer(cfg.model, cfg.memory)
    model.init_weights()
    init_value_tables(model, cfg.seed)
    import_init(cfg, source, model, tokenizer, log)
    return model


def _data_overridden(overrides: list[str]) -> bool:
    return any(o.split("=", 1)[0].lstrip("+~") in ("data", "experiment") or o.startswith("data.") for o in overrides)


def check_override_keys(overrides: list[str], name: str) -> None:
    """Before the load: each override of a checkpoint's config is key=value of a known key that
    the count reads (data.*, seed); any other, which the checkpoint's model would ignore, is refused."""
    for override in overrides:
        key, sep, value = override.lstrip("+~").partition("=")
        if not sep:
            raise ConfigError("overrides", override, "key=value (e.g. data.micro_batch=8)")
        if key in GROUPS:
            raise ConfigError(key, value, f"{key}.* keys: a checkpoint's saved config takes key=value changes, not "
                              f"a preset of configs/{key}/ (e.g. data.kind=..., data.sources=...)")
    if (unknown := unknown_key_error(overrides, Config, GROUPS)) is not None:
        raise unknown
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if not (key.startswith("data.") or key == "seed"):
            raise ConfigError(key, value, f"data.* or seed: {name} is a checkpoint, whose model (model.*, memory.*, "
                              "finetune.*) is the one it saved, so slot_usage counts its reads over the data you "
                              "name and would ignore this key (for another model, name its checkpoint or export)")


def saved_with_overrides(saved: Config, overrides: list[str]) -> Config:
    """A checkpoint's saved config with `overrides` (checked by check_override_keys) applied, validated."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(saved), OmegaConf.from_dotlist(overrides))
    except OmegaConfBaseException as err:  # a value of the wrong type: one line naming the key
        key = getattr(err, "full_key", "") or "overrides"
        value = dict(o.lstrip("+~").split("=", 1) for o in overrides).get(key, overrides)
        raise ConfigError(key, value, f"a value of the key's type (OmegaConf: {str(err).splitlines()[0]})") from None
    cfg = OmegaConf.to_object(merged)
    cfg.validate()
    return cfg


def _checkpoint_model(name: str, overrides: list[str]):
    """A checkpoint's model and its run's config, with `overrides` applied to that config."""
    check_override_keys(overrides, name)
    loaded = load_model(name)
    cfg = saved_with_overrides(loaded.config, overrides) if overrides else loaded.config
    loader = build_train_loader(cfg, ONE_PROCESS, "train")
    return loaded.model, cfg, loader, loaded.step, loaded.source / FILE


def _started_model(name: str, overrides: list[str], out: str):
    """The model a run with `overrides` and init_from=<name> (an export or a Llama) starts from."""
    if not out:
        raise ConfigError("--out", "", f"a file to write with {name}, which is no checkpoint folder (the "
                          "fine-tune then reads it with finetune.background=<file>)")
    source = model_source(name)
    cfg = compose([*overrides, f"init_from={name}"])
    if not _data_overridden(overrides):  # an export's own corpus; a Llama records none
        data = data_config(source.directory) if source.kind == "export" else None
        if data is None:
            raise ConfigError("data", cfg.data.kind, f"the corpus to count reads on (data=... or data.* "
                              f"overrides): {name} records no training data")
        cfg.data = data
        cfg.validate()
    source = check_import_source(cfg, source)  # the architecture the overrides describe is the one at `name`
    loader = build_train_loader(cfg, ONE_PROCESS, "train")
    model = start_model(cfg, source, getattr(loader, "tokenizer", None), lambda line: print(line, flush=True))
    return model, cfg, loader, 0, Path(out)


def background(name: str, batches: int, out: str = "", overrides: list[str] | None = None,
               overwrite: bool = False) -> Path:
    """Count the reads of `batches` batches through the model `name` names; returns the file written
    (an existing slot-usage file there is replaced only with `overwrite`)."""
    if batches < 1:
        raise ConfigError("--batches", batches, "an integer >= 1")
    overrides = list(overrides or [])
    if model_source(name).kind == "checkpoint":
        model, cfg, loader, step, default = _checkpoint_model(name, overrides)
    else:
        model, cfg, loader, step, default = _started_model(name, overrides, out)
    if not memory_layers(model):
        raise ConfigError("model", name, f"a model with product-key memory layers or others that count their "
                          f"reads per row (its memory.kind is "
                          f"{cfg.memory.kind}; for a Llama or a dense export, the overrides of the retrofit: "
                          "memory=memplus memory.layers=[...])")
    path = Path(out) if out else default
    check_output_file(path, "slot-usage file", is_usage_file, "--overwrite", overwrite)  # before the count
    apply_knn_schedule(model, cfg.memory, step)
    counts, tokens, batch_read, batches_read = collect(model, loader, batches, torch.device("cpu"))
    save_usage(path, counts, tokens, name, batches_read, batches)
    print(f"[slot-usage] {tokens:,} tokens of {cfg.data.kind} data through {name} -> {path}")
    for line in describe(counts):
        print(f"[slot-usage] {line}")
    slots = {label: counts[names[0]].numel() for label, names in value_tables(memory_layers(model)).items()}
    for line in describe_batch_reads(batch_read, slots, f"{cfg.data.micro_batch} x {cfg.data.seq_len} tokens"):
        print(f"[slot-usage] {line}")
    return path


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memlm.train.slot_usage", description=__doc__.split("\n\n")[0],
                                     epilog="docs/finetuning.md shows each path")
    parser.add_argument("model", help="a checkpoint folder, its run's dump_dir or checkpoints/latest, an export, "
                        "or hf:<Llama dir>")
    parser.add_argument("--batches", type=int, default=64, help="batches of the data to count (default 64)")
    parser.add_argument("--out", default="", help=f"output file (default for a checkpoint: {FILE} beside it; "
                        "needed for an export or a Llama)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing slot-usage file at the "
                        "output path (beside a checkpoint, maybe the background its training recorded)")
    parser.add_argument("overrides", nargs="*", help="key=value: for a checkpoint, changes to its run's saved "
                        "config (e.g. its data); for an export or a Llama, the fine-tune run's overrides")
    args = parser.parse_intermixed_args(argv)  # overrides before or after the options
    background(args.model, args.batches, args.out, args.overrides, args.overwrite)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
