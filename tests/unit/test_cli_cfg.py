"""`python -m memlm.train --cfg job|hydra|all` as Hydra users type it (memlm.train.show_config)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from memlm.config.run import compose, to_yaml
from memlm.errors import ConfigError
from memlm.train.cli import main
from memlm.train.show_config import split_cfg_flag

OVERRIDES = ["model=tiny", "memory=memplus", "memory.layers=[1]", "steps=7"]


@pytest.mark.parametrize("argv, mode", [
    (["--cfg", "job"], "job"), (["--cfg", "hydra"], "hydra"), (["--cfg", "all"], "all"), (["-c", "job"], "job"),
    (["-c", "all"], "all"), (["--cfg=hydra"], "hydra"), (["--cfg"], "job"), (["--cfg", "--resolve"], "job"), ([], None),
])
def test_split_cfg_flag_spellings(argv, mode):
    assert split_cfg_flag([OVERRIDES[0], *argv, *OVERRIDES[1:]]) == (mode, OVERRIDES)


def test_a_bare_cfg_before_an_override_keeps_the_override():
    assert split_cfg_flag(["--cfg", "steps=3"]) == ("job", ["steps=3"])


@pytest.mark.parametrize("argv", [["--cfg", "jobs"], ["--cfg=everything"], ["-c", "hydar"]])
def test_unknown_cfg_mode_names_the_value_and_the_choices(argv):
    with pytest.raises(ConfigError, match="one of: job, hydra, all"):
        split_cfg_flag(argv)


def test_cfg_job_prints_the_composed_config(capsys):
    expected = to_yaml(compose(OVERRIDES))
    for flag in (["--cfg", "job"], ["-c", "job"], ["--cfg"]):
        assert main([*flag, *OVERRIDES]) == 0
        assert capsys.readouterr().out == expected + "\n"


def test_cfg_hydra_prints_the_composition(capsys):
    assert main(["--cfg", "hydra", *OVERRIDES]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# memlm composes with Hydra's compose API, not @hydra.main")
    hydra = yaml.safe_load(out)["hydra"]
    assert set(yaml.safe_load(out)) == {"hydra"}
    assert hydra["overrides"]["task"] == OVERRIDES
    assert hydra["runtime"]["choices"]["model"] == "tiny" and hydra["runtime"]["choices"]["memory"] == "memplus"
    assert not any(group.startswith("hydra/") for group in hydra["runtime"]["choices"])
    assert hydra["job"]["config_name"] == "config"


def test_cfg_all_is_job_plus_hydra(capsys):
    assert main(["--cfg", "all", *OVERRIDES]) == 0
    both = yaml.safe_load(capsys.readouterr().out)
    assert main(["--cfg", "hydra", *OVERRIDES]) == 0
    hydra = yaml.safe_load(capsys.readouterr().out)
    job = yaml.safe_load(to_yaml(compose(OVERRIDES)))
    assert both == {**job, **hydra}


def test_bad_mode_or_override_exits_2(capsys):
    assert main(["--cfg", "jobs"]) == 2
    assert "--cfg='jobs'" in capsys.readouterr().err
    assert main(["--cfg", "hydra", "model=nope"]) == 2
    assert "model='nope'" in capsys.readouterr().err


def test_help_lists_the_modes():
    out = subprocess.run([sys.executable, "-m", "memlm.train", "--help"], capture_output=True, text=True,
                         timeout=300).stdout
    for text in ("--cfg job", "--cfg hydra", "--cfg all", "-c job|hydra|all", "not @hydra.main"):
        assert text in out
