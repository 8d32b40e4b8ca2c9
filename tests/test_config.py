"""Composition of the Hydra configs and validation of bad values."""

from __future__ import annotations

import pytest

from memlm.errors import ConfigError
from memlm.model import ModelArgs
from memlm.train.config import Config, compose, group_options


def test_default_compose_is_typed():
    cfg = compose()
    assert isinstance(cfg, Config)
    assert isinstance(cfg.model, ModelArgs)
    assert cfg.model.name == "tiny"
    assert cfg.dump_dir == "runs/run"  # interpolation resolved


def test_every_preset_of_every_group_composes():
    for group in ("model", "memory", "data", "optim", "parallel", "eval", "experiment"):
        for preset in group_options(group):
            # Memory presets spread layers through the depth: give them a deep model.
            base = ["model=134m"] if group == "memory" else []
            compose([*base, f"{group}={preset}"])


def test_overrides_apply():
    cfg = compose(["model=373m", "model.n_layers=4", "optim.lr=1e-3", "name=x"])
    assert (cfg.model.dim, cfg.model.n_layers, cfg.optim.lr, cfg.dump_dir) == (1024, 4, 1e-3, "runs/x")


def test_373m_shape():
    m = compose(["model=373m"]).model
    assert (m.dim, m.n_layers, m.n_heads) == (1024, 24, 16)


BAD = [
    (["model.dim=66"], "model.dim", "multiple of model.n_heads=4"),
    (["model.n_kv_heads=3"], "model.n_kv_heads", "divisor of model.n_heads=4"),
    (["model.ffn=conv"], "model.ffn", "dense"),
    (["model=huge"], "model", "tiny"),
    (["memory=bogus"], "memory", "none"),
    (["model.n_layers=0"], "model.n_layers", "positive integer"),
    (["data.seq_len=4096"], "data.seq_len", "model.max_seq_len=512"),
    (["optim.schedule=exp"], "optim.schedule", "cosine"),
    (["parallel.fsdp=zero3"], "parallel.fsdp", "hybrid"),
    (["model.dim=abc"], "model.dim", "abc"),
    (["model.not_a_key=1"], "model.not_a_key", "not_a_key"),
]


@pytest.mark.parametrize("overrides,key,valid", BAD, ids=[b[0][0] for b in BAD])
def test_bad_values_fail_at_compose_naming_key_and_valid_values(overrides, key, valid):
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    message = str(err.value)
    assert key in message
    assert valid in message


def test_error_names_the_value():
    with pytest.raises(ConfigError, match=r"model\.dim=66"):
        compose(["model.dim=66"])


def test_demo_experiment_sets_its_values():
    cfg = compose(["experiment=demo"])
    assert cfg.name == "demo" and cfg.dump_dir == "runs/demo"
