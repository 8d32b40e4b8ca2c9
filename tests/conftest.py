"""Shared test settings and fixtures."""

from __future__ import annotations

import pytest
import torch

# The cores are shared (spawned ranks, other jobs): one intra-op thread per
# process avoids OpenMP spin-waiting, which makes small models 10-50x slower.
torch.set_num_threads(1)


def compose_and_build(overrides=(), seed: int = 0):
    """The trainer's path for one process: compose a config, build on meta, init."""
    from memlm.config.run import compose
    from memlm.model import build_model

    cfg = compose(list(overrides))
    return build_model(cfg.model, cfg.memory, seed=seed), cfg


@pytest.fixture
def tiny_model():
    model, _ = compose_and_build()
    return model.eval()
