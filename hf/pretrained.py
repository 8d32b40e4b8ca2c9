"""Load an exported model: `memlm.model.from_pretrained(out_dir)`.

An export directory (written by `python -m memlm.hf.export`) holds
`memlm_config.json` (model + memory config and the weight layout),
`model.safetensors` or shards listed in `model.safetensors.index.json`, and
for dense models a Hugging Face `config.json` (their weights use the HF Llama
names, so `transformers` loads the same directory); other models get a
`config.json` with `auto_map` and the modeling files of hf/remote/
(`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from memlm.hf.mapping import from_hf_state_dict
from memlm.memory.config import MemoryConfig
from memlm.model.args import ModelArgs
from memlm.model.build import build_model
from memlm.model.transformer import Transformer

CONFIG_NAME = "memlm_config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def _dataclass_from(cls, values: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} keys in {CONFIG_NAME}: {unknown}")
    return cls(**values)


def read_config(directory: str | Path) -> tuple[ModelArgs, MemoryConfig, dict[str, Any]]:
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a memlm export directory")
    meta = json.loads(path.read_text())
    return _dataclass_from(ModelArgs, meta["model"]), _dataclass_from(MemoryConfig, meta["memory"]), meta


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a directory: the shards its index lists, or the single file."""
    directory = Path(directory)
    index = directory / INDEX_NAME
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = [WEIGHTS_NAME]
    for name in names:
        if not (directory / name).is_file():
            raise FileNotFoundError(f"weight file {directory / name} is missing")
    return [directory / name for name in names]


def load_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        state.update(load_file(str(path)))
    return state


def from_pretrained(directory: str | Path, device: str | torch.device = "cpu") -> Transformer:
    """Build the exported model and load its weights (safetensors only, no pickle)."""
    args, memory, meta = read_config(directory)
    model = build_model(args, memory if memory.kind != "none" else None, device=device)
    state = load_weights(directory)
    if meta.get("weights_layout") == "hf_llama":
        state = from_hf_state_dict(state, args)
    model.load_state_dict(state, strict=True)
    return model.eval()
