"""The Triton read's algorithm and launches are config values (memory.triton_algorithm,
memory.triton_forward, memory.triton_backward: memory/fast/launches.py): validated
with the config's error path, recorded in the run's config, and held by the
model built with them (each model its own), which passes them to every read. No
GPU and no Triton kernel needed: the choice of launch is plain Python.
"""

from __future__ import annotations

import pytest
import torch

from memlm.config.run import compose
from memlm.errors import ConfigError
from memlm.memory.fast import launches

TINY = ["model=tiny", "memory=memplus", "memory.layers=[1]", "memory.n_keys=8", "memory.knn=4", "memory.eval_knn=4",
        "memory.heads=2", "memory.k_dim=16"]


def test_defaults_are_the_rule():
    cfg = compose(TINY)
    assert (cfg.memory.triton_algorithm, cfg.memory.triton_forward, cfg.memory.triton_backward) == ("segments", [], [])
    assert launches.segments_launch(1024, torch.bfloat16) == launches.Launch(8, 4, 1024, 4, 1)
    assert launches.forward_launch(1024, 128, 16384, torch.float32) == launches.Launch(1, 4, 1024, 8, 1)


@pytest.mark.parametrize("key,value,valid", [
    ("triton_algorithm", "by_slot", "one of: segments"),
    ("triton_forward", "[1,8,4]", "[] or 6 integers: block_b, block_k, num_warps, num_stages, maxnreg, busiest_first"),
    ("triton_forward", "[3,8,4,1,0,0]", "block_b and block_k powers of two"),
    ("triton_backward", "[8,4,3,1,0,0]", "num_warps one of 1, 2, 4, 8, 16, 32"),
    ("triton_backward", "[8,4,4,0,0,0]", "num_stages >= 1"),
    ("triton_backward", "[8,4,4,1,300,0]", "maxnreg 0 (the compiler's choice) or in [16, 255]"),
    ("triton_backward", "[8,4,4,1,0,2]", "busiest_first 0 or 1"),
])
def test_invalid_values_name_the_key_and_what_is_valid(key, value, valid):
    with pytest.raises(ConfigError) as err:  # composing validates
        compose([*TINY, f"memory.{key}={value}"])
    assert err.value.key == f"memory.{key}" and valid in str(err.value)


def test_a_built_model_holds_its_launches_and_the_config_records_them():
    from omegaconf import OmegaConf

    from memlm.model import build_model

    cfg = compose([*TINY, "memory.triton_forward=[2,16,4,1,128,0]", "memory.triton_backward=[16,2,1,1,0,1]"])
    model = build_model(cfg.model, cfg.memory)
    (layer,) = [m for m in model.modules() if hasattr(m, "launches")]
    assert layer.launches == launches.ReadLaunches((2, 16, 4, 1, 128, 0), (16, 2, 1, 1, 0, 1))
    forward = launches.forward_launch(64, 8, 32, torch.float32, layer.launches.forward)
    backward = launches.segments_launch(64, torch.bfloat16, layer.launches.backward)
    assert forward == launches.Launch(2, 16, 64, 4, 1, 128, False)  # BLOCK_D stays the rule's
    assert backward == launches.Launch(16, 2, 64, 1, 1, None, True)  # maxnreg 0: the compiler's choice
    recorded = OmegaConf.to_container(OmegaConf.structured(cfg))["memory"]
    assert (recorded["triton_forward"], recorded["triton_backward"]) == ([2, 16, 4, 1, 128, 0], [16, 2, 1, 1, 0, 1])
    other = build_model(cfg.model, compose(TINY).memory)  # another model in the same process: its own (none)
    assert [m.launches for m in other.modules() if hasattr(m, "launches")] == [launches.NO_LAUNCHES]
    assert layer.launches.forward == (2, 16, 4, 1, 128, 0)  # the first model's are untouched
    assert launches.forward_launch(64, 8, 32, torch.float32) == launches.Launch(2, 8, 64, 1, 1)


def test_config_launches_come_before_measured_ones(monkeypatch):
    measured = launches.Launch(1, 8, 1024, 2, 1, None, False)
    monkeypatch.setitem(launches.MEASURED, ("forward", 1024, 2), measured)
    assert launches.forward_launch(1024, 128, 16384, torch.bfloat16) == measured
    assert launches.forward_launch(1024, 128, 16384, torch.bfloat16, (1, 16, 8, 1, 255, 0)) == \
        launches.Launch(1, 16, 1024, 8, 1, 255, False)


def test_read_launches_refuses_what_the_config_would():
    with pytest.raises(ValueError, match=r"triton_forward=\[1, 2\] is invalid: \[\] or 6 integers"):
        launches.read_launches("segments", [1, 2], [])
    with pytest.raises(ValueError, match="triton_algorithm='atomic' is invalid: one of segments"):
        launches.read_launches("atomic", [], [])
