"""Load a trained model for inference or evaluation, from whatever a run left.

`load_model(path)` accepts a checkpoint directory, a `checkpoints/latest`
file, a run's `dump_dir` (its newest checkpoint), or an export directory
(`python -m memlm.train.export`). This is train's public entry point for
other packages (evals, launch): they never touch checkpoint internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from memlm.model import Transformer, build_model
from memlm.model.pretrained import CONFIG_NAME, from_pretrained
from memlm.train.checkpoint import Checkpointer, verify
from memlm.train.config import Config, from_yaml


@dataclass
class LoadedModel:
    model: Transformer  # in eval mode
    config: Config | None  # the run's config (None for an export directory)
    tokenizer_path: str | None  # sentencepiece model, when the run had one
    step: int
    source: Path


def resolve_checkpoint_dir(path: str | Path) -> Path:
    path = Path(path)
    if path.name == "latest" and path.is_file():
        return path.parent / path.read_text().strip()
    if (path / "checkpoints" / "latest").is_file():
        return resolve_checkpoint_dir(path / "checkpoints" / "latest")
    return path


def run_tokenizer_path(cfg: Config) -> str | None:
    """The tokenizer file a run trained with (the synthetic corpus makes its own)."""
    if cfg.data.tokenizer:
        return cfg.data.tokenizer
    if cfg.data.kind == "synthetic":
        from memlm.data.corpus import materialize_synthetic

        return materialize_synthetic(cfg.data)["tokenizer"]
    return None


def load_model(path: str | Path, device: str | torch.device = "cpu") -> LoadedModel:
    path = Path(path)
    if (path / CONFIG_NAME).is_file():  # an export directory
        tok = path / "tokenizer.model"
        import json

        step = json.loads((path / CONFIG_NAME).read_text()).get("step", 0)
        return LoadedModel(from_pretrained(path, device), None, str(tok) if tok.is_file() else None, step, path)
    directory = resolve_checkpoint_dir(path)
    meta = verify(directory)
    cfg = from_yaml(meta["config"])
    model = build_model(cfg.model, cfg.memory if cfg.memory.kind != "none" else None, device=device)
    Checkpointer.load_weights(directory, model)
    return LoadedModel(model.eval(), cfg, run_tokenizer_path(cfg), meta["step"], directory)
