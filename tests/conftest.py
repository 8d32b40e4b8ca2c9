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


@pytest.fixture
def matmul_precision():
    """Restores every matmul precision setting a test changes (process-wide
    flags): the legacy one and, from torch 2.9, the per-backend strings. A
    legacy flag set in a test (allow_tf32) writes the string too, which would
    otherwise stay set for the tests after it."""
    strings = hasattr(torch._C, "_get_fp32_precision_getter")
    pairs = [("generic", "all"), ("cuda", "matmul"), ("mkldnn", "matmul")] if strings else []
    legacy = torch.get_float32_matmul_precision()
    saved = {pair: torch._C._get_fp32_precision_getter(*pair) for pair in pairs}
    yield
    torch.set_float32_matmul_precision(legacy)
    for pair, value in saved.items():
        torch._C._set_fp32_precision_setter(*pair, value)
