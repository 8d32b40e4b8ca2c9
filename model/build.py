"""Build a ready-to-use model for one process: meta construction, then
materialization on `device`, then initialization.

The trainer does the same three steps with parallelization in between;
evaluation, export and tests use this directly."""

from __future__ import annotations

from typing import Any

import torch

from memlm.model.args import ModelArgs
from memlm.model.transformer import Transformer


def build_model(
    args: ModelArgs, memory: Any = None, device: str | torch.device = "cpu", seed: int | None = None
) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args, memory)
    model.to_empty(device=device)
    if seed is not None:
        torch.manual_seed(seed)
    model.init_weights()
    return model
