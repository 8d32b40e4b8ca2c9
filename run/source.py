"""What a model path names: the one rule every command applies to it.

    source = model_source("runs/base")            # ModelSource(kind="checkpoint", directory=.../step_N)
    model_source("runs/base/checkpoints/latest")  # the same newest checkpoint
    model_source("exports/base")                  # kind="export": memlm_config.json (python -m memlm.hf.export)
    model_source("hf:/models/llama")              # kind="hf": a Hugging Face Llama (save_pretrained)

Read from the folder's files:
- a memlm export (`memlm_config.json`), named with or without `hf:`; with `hf:`
  only an export in memlm's own weights layout, since a dense export is also
  a Llama (HF names, `config.json`) and `hf:` then imports it as one;
- `hf:<dir>`: a Hugging Face Llama;
- anything else: a memlm checkpoint, named as its folder (`step_N`), its run's
  dump_dir or its `checkpoints/latest` file: the newest complete checkpoint
  (checkpoint/folder.py's reader rule, right while a re-save is between its renames).

`init_from`, `python -m memlm.evals checkpoint=...`, `python -m memlm.generate`
and `python -m memlm.train.slot_usage` all accept every kind this way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memlm.checkpoint.folder import LATEST, latest_checkpoint
from memlm.config.run import HF_PREFIX
from memlm.hf.pretrained import CONFIG_NAME

KINDS = ("checkpoint", "export", "hf")


@dataclass(frozen=True)
class ModelSource:
    kind: str  # one of KINDS
    directory: Path  # the checkpoint folder (resolved), the export folder or the Llama folder
    name: str  # as the user wrote it
    # What the run's preflight read and checked there, so the load does not read it again
    # (memlm.train.preflight.check_init_from): a checkpoint's meta.json, an export's
    # (ModelArgs, MemoryConfig, memlm_config.json), a Llama's ModelArgs. None: not read yet.
    checked: Any = None


def strip_prefix(name: str) -> Path:
    """The folder `name` names, with or without the `hf:` prefix."""
    return Path(name[len(HF_PREFIX):] if name.startswith(HF_PREFIX) else name)


def export_layout(directory: Path) -> str | None:
    """The weights_layout of an export's memlm_config.json (None: not an export)."""
    path = directory / CONFIG_NAME
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("weights_layout", "memlm")
    except (ValueError, AttributeError):  # unreadable: reading the export names the problem
        return "memlm"


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """A checkpoint directory from what the user named: a `latest` file or a
    run's dump_dir -> the checkpoint `latest` names; else the path itself."""
    path = Path(path)
    if path.name == LATEST and path.is_file():
        return latest_checkpoint(path.parent) or path.parent / path.read_text().strip()
    if (path / "checkpoints").is_dir():
        return latest_checkpoint(path / "checkpoints") or path
    return path


def model_source(name: str | Path) -> ModelSource:
    name = str(name)
    directory = strip_prefix(name)
    layout = export_layout(directory)
    if name.startswith(HF_PREFIX):
        return ModelSource("export" if layout == "memlm" else "hf", directory, name)
    if layout is not None:
        return ModelSource("export", directory, name)
    return ModelSource("checkpoint", resolve_checkpoint_dir(directory), name)


def is_export_dir(path: str | Path) -> bool:
    return model_source(path).kind == "export"
