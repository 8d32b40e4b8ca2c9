"""Sweeps: Hydra sweep syntax -> Cartesian product of points, their names and
run directories, validation before anything runs, the summary, and `-m`."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from launch_helpers import TINY, fake_slurm

import memlm.launch.local as local
from memlm.errors import ConfigError
from memlm.evals.report import eval_metrics
from memlm.launch.cli import main
from memlm.launch.multirun import multirun
from memlm.launch.sweep import SweepPoint, expand, plan, safe_dirname, summary_table


class RecordingPopen:
    """Stands in for subprocess.Popen: records each command and 'succeeds'."""

    commands: list[list[str]] = []

    def __init__(self, cmd, env=None):
        RecordingPopen.commands.append(list(cmd))

    def wait(self):
        return 0


@pytest.fixture
def recorded(monkeypatch):
    RecordingPopen.commands = []
    monkeypatch.setattr(local.subprocess, "Popen", RecordingPopen)
    return RecordingPopen.commands


def test_cartesian_product_in_argument_order():
    swept, points = expand(["memory.n_keys=128,256,512", "memory.knn=16,32", "steps=5"])
    assert swept == ["memory.n_keys", "memory.knn"]
    assert len(points) == 6
    assert points[0] == ["memory.n_keys=128", "memory.knn=16", "steps=5"]
    assert points[1] == ["memory.n_keys=128", "memory.knn=32", "steps=5"]
    assert points[-1] == ["memory.n_keys=512", "memory.knn=32", "steps=5"]


def test_range_choice_and_glob():
    assert expand(["steps=range(1,7,2)"])[1] == [["steps=1"], ["steps=3"], ["steps=5"]]
    assert expand(["optim.lr=choice(1e-3,3e-3)"])[1] == [["optim.lr=0.001"], ["optim.lr=0.003"]]
    assert expand(["model=glob(1*)"])[1] == [["model=134m"], ["model=1b"]]  # presets of configs/model/
    assert expand(["memory.layers=[1],[0,1]"])[1] == [["memory.layers=[1]"], ["memory.layers=[0,1]"]]


@pytest.mark.parametrize("args,message", [
    (["steps=1,,2"], r"Hydra sweep syntax.*Hydra said"),
    (["steps=range(1"], r"Hydra sweep syntax"),
    (["optim.lr=interval(0,1)"], r"interval\(\) needs an optimizing sweeper"),
    (["optim.lr=glob(*)"], r"glob\(\) only expands config groups"),
    (["model=glob(zzz*)"], r"at least one value"),
    (["steps=1,2", "steps=3,4"], r"steps appears twice"),
])
def test_bad_sweeps_are_named(args, message):
    with pytest.raises(ConfigError, match=message):
        expand(args)


def test_points_get_their_own_dump_dir_and_name(tmp_path):
    points = plan(["model.n_layers=1,2", "optim.lr=1e-3,3e-3"], [*TINY, f"dump_dir={tmp_path}", "name=sw"], 1,
                  "--nproc 1")
    assert [p.label for p in points] == ["model.n_layers=1,optim.lr=0.001", "model.n_layers=1,optim.lr=0.003",
                                         "model.n_layers=2,optim.lr=0.001", "model.n_layers=2,optim.lr=0.003"]
    assert points[0].dump_dir == tmp_path / "model.n_layers=1,optim.lr=0.001"
    assert points[0].overrides[-1] == "name='sw/model.n_layers=1,optim.lr=0.001'"
    assert len({p.dump_dir for p in points}) == 4
    from memlm.config.run import compose

    cfg = compose(points[3].overrides)  # the quoted values reach the trainer unchanged
    assert (cfg.model.n_layers, cfg.optim.lr, cfg.name) == (2, 3e-3, "sw/model.n_layers=2,optim.lr=0.003")
    assert cfg.dump_dir == str(tmp_path / "model.n_layers=2,optim.lr=0.003")


def test_directory_names_are_sanitized():
    assert safe_dirname("data.path='/a b',x=[1,2]") == "data.path=__a_b_,x=_1,2_"
    long = safe_dirname("x=" + "a" * 400)
    assert len(long) < 160 and long != safe_dirname("x=" + "a" * 399)


def test_invalid_point_and_conflicts_fail_before_running(recorded, capsys, tmp_path):
    assert main(["sweep", "optim.lr=1e-3,-1", "--", *TINY, f"dump_dir={tmp_path}"]) == 2
    assert re.search(r"optim.lr=-1.0.*sweep point 2/2", capsys.readouterr().err)
    assert main(["sweep", "steps=1,2", "--", "steps=3"]) == 2
    assert "either swept" in capsys.readouterr().err
    assert main(["sweep", "dump_dir=a,b"]) == 2
    assert "the sweep sets dump_dir" in capsys.readouterr().err
    assert main(["sweep", "steps=1,,2", "--", *TINY]) == 2
    assert "Hydra said" in capsys.readouterr().err
    assert main(["sweep", "model.n_layers=1,2", "--nproc", "3", "--", "parallel.memory_parallel=2"]) == 2
    assert "--nproc 3 gives 3" in capsys.readouterr().err
    assert recorded == [], "no process may start"


def test_eval_metrics_and_summary_table(tmp_path):
    (tmp_path / "evals").mkdir()
    (tmp_path / "evals" / "4.json").write_text(json.dumps({"step": 4, "results": {"nq": {"em": 0.1}}}))
    (tmp_path / "evals" / "10.json").write_text(json.dumps({"step": 10, "results": {"nq": {"em": 0.25},
                                                                                  "ppl": 12.5}}))
    assert eval_metrics(tmp_path) == {"nq/em": 0.25, "ppl": 12.5}
    point = SweepPoint("memory.knn=16", ["memory.knn=16"], [], tmp_path,
                       {"status": "ok", "total": 1234567, "active": 1000, "flops_per_token": 217344,
                        "final_loss": 5.125, "val_loss": None, "evals": eval_metrics(tmp_path)})
    table = summary_table([point]).splitlines()
    assert table[0].split() == ["point", "status", "params", "active", "fwd_flops/token", "final_loss",
                                "val_loss", "nq/em", "ppl"]
    assert table[1].split() == ["memory.knn=16", "ok", "1,234,567", "1,000", "217,344", "5.125", "-", "0.25",
                                "12.5"]


def test_multirun_runs_each_point_with_memlm_train(recorded, tmp_path, capsys):
    rc = multirun(["-m", "model.n_layers=1,2", *TINY, f"dump_dir={tmp_path}"])
    assert rc == 0, capsys.readouterr().err
    assert len(recorded) == 2
    for cmd, layers in zip(recorded, (1, 2)):
        assert cmd[1:3] == ["-m", "memlm.train"]
        assert f"model.n_layers={layers}" in cmd and f"dump_dir='{tmp_path}/model.n_layers={layers}'" in cmd
    out = capsys.readouterr().out
    assert "point 2/2" in out and "model.n_layers=2" in out
    assert (tmp_path / "sweep.json").exists()


def test_multirun_refuses_torchrun_and_flags(recorded, monkeypatch, capsys):
    assert multirun(["-m", "--cfg", "steps=1,2"]) == 2
    assert "takes only Hydra overrides" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert multirun(["-m", "steps=1,2"]) == 2
    assert "memlm.launch sweep --nproc" in capsys.readouterr().err
    assert recorded == []


@pytest.mark.slow
def test_two_point_local_sweep_trains_and_summarizes(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rc = main(["sweep", "model.n_layers=1,2", "--", *TINY, f"dump_dir={tmp_path}", "name=sw"])
    stdout, stderr = capfd.readouterr()
    assert rc == 0, stdout + stderr
    for layers in (1, 2):
        summary = json.loads((tmp_path / f"model.n_layers={layers}" / "summary.json").read_text())
        assert summary["steps"] == 4 and summary["name"] == f"sw/model.n_layers={layers}"
    table = stdout[stdout.index("2/2 point(s) finished"):].splitlines()
    assert table[1].split()[:6] == ["point", "status", "params", "active", "fwd_flops/token", "final_loss"]
    rows = {line.split()[0]: line.split() for line in table[2:4]}
    assert set(rows) == {"model.n_layers=1", "model.n_layers=2"}
    assert all(r[1] == "ok" for r in rows.values())
    params = {k: int(r[2].replace(",", "")) for k, r in rows.items()}
    assert params["model.n_layers=1"] < params["model.n_layers=2"]
    record = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["point"] for r in record] == ["model.n_layers=1", "model.n_layers=2"]
    assert all(isinstance(r["final_loss"], float) for r in record)
    assert Path(record[0]["dump_dir"]) == tmp_path / "model.n_layers=1"


def test_slurm_sweep_submits_one_job_per_point_sharing_one_snapshot(tmp_path, capsys, monkeypatch):
    sweep = ["sweep", "seed=1,2", "--slurm", "--gpus-per-node", "1"]
    fixed = ["--", *TINY, f"dump_dir={tmp_path}/sw"]
    assert main([*sweep, "--dry-run", *fixed]) == 0
    scripts = capsys.readouterr().out.split("#!/bin/bash")[1:]
    assert len(scripts) == 2 and not (tmp_path / "sw").exists()
    for script, seed in zip(scripts, (1, 2)):
        expected = f"seed={seed} \"name='run/seed={seed}'\" \"dump_dir='{tmp_path}/sw/seed={seed}'\""
        assert expected in script  # Hydra quotes inside shell double quotes
        assert f"export PYTHONPATH={tmp_path}/sw/launch/code" in script
    bin_dir, log = fake_slurm(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_LOG", str(log))
    assert main([*sweep, *fixed]) == 0, capsys.readouterr().err
    assert log.read_text().splitlines() == [f"sbatch {tmp_path}/sw/seed={s}/launch/job.sbatch" for s in (1, 2)]
    assert (tmp_path / "sw" / "launch" / "code" / "memlm" / "train" / "cli.py").is_file()
    assert not (tmp_path / "sw" / "seed=1" / "launch" / "code").exists()  # one snapshot for the sweep


@pytest.mark.slow
def test_concurrent_local_sweep_logs_each_point(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rc = main(["sweep", "model.n_layers=1,2", "--jobs", "2", "--", *TINY, f"dump_dir={tmp_path}", "name=sw"])
    stdout, stderr = capfd.readouterr()
    assert rc == 0, stdout + stderr
    assert stdout.count("started:") == 2 and "2/2 point(s) finished" in stdout
    for layers in (1, 2):
        point = tmp_path / f"model.n_layers={layers}"
        assert json.loads((point / "summary.json").read_text())["steps"] == 4
        assert "[train] done" in (point / "sweep.log").read_text()  # the point's output, not the console's
    assert "[train] done" not in stdout
    assert [r["status"] for r in json.loads((tmp_path / "sweep.json").read_text())] == ["ok", "ok"]


def test_bad_jobs_values(capsys):
    assert main(["sweep", "seed=1,2", "--jobs", "0", "--", *TINY]) == 2
    assert "--jobs 0: must be an integer >= 1" in capsys.readouterr().err
    assert main(["sweep", "seed=1,2", "--jobs", "2", "--slurm", "--gpus-per-node", "1", "--", *TINY]) == 2
    assert "with --slurm every point is its own job" in capsys.readouterr().err


def test_one_point_sweep_is_labelled_by_its_arguments():
    from memlm.launch.sweep import expand, point_label

    swept, points = expand(["memory.n_keys=32"])
    assert [point_label(p, swept) for p in points] == ["memory.n_keys=32"]
    swept, points = expand(["memory.n_keys=32,64", "optim.lr=1e-3"])
    assert [point_label(p, swept) for p in points] == ["memory.n_keys=32", "memory.n_keys=64"]


def test_a_base_value_every_point_overrides_does_not_refuse_the_sweep(recorded, tmp_path, capsys):
    """The issue's sweep: the memplus preset's memory.knn=32 exceeds memory.n_keys=16, but every point sets
    its own knn; each point is validated as composed, and an invalid one is named."""
    base = ["--", "memory=memplus", "memory.layers=[1]", "memory.n_keys=16", "memory.eval_knn=8", "memory.k_dim=64",
            "data=synthetic", "steps=20", "name=k2", f"dump_dir={tmp_path}"]
    assert main(["sweep", "memory.knn=4,8", "--dry-run", *base]) == 0
    assert [line.split("memory.knn=")[1].split()[0] for line in capsys.readouterr().out.splitlines()] == ["4", "8"]
    assert main(["sweep", "memory.knn=4,32", "--dry-run", *base]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: invalid config value memory.knn=32"), err
    assert err.endswith("(sweep point 2/2: memory.knn=32)"), err
    assert multirun(["-m", "memory.knn=4,8", *base[1:]]) == 0  # memlm.train -m: the same points run
    assert [[a for a in cmd if a.startswith("memory.knn=")] for cmd in recorded] == [["memory.knn=4"],
                                                                                  ["memory.knn=8"]]
    assert multirun(["-m", "memory.knn=4,32", *base[1:]]) == 2
    assert "(sweep point 2/2: memory.knn=32)" in capsys.readouterr().err


def test_memplus_on_a_shallow_model_names_memory_layers():
    """memory=memplus spreads more layers than the default 2-block model has: the error says how to place them."""
    from memlm.config.run import compose

    with pytest.raises(ConfigError, match=r"memory.spread=\d+: an integer in \[0, 2\] \(model.n_layers=2\).*"
                                          r"name the blocks with memory.layers=\[1\], or set memory.spread<=2"):
        compose(["memory=memplus"])
    assert compose(["memory=memplus", "memory.layers=[1]"]).memory.resolved_layers(2) == [1]


# ---- every launch command of docs/launch.md, in a tiny form ---------------------------------------

DOCS = Path(__file__).resolve().parents[2] / "docs" / "launch.md"


def _docs_commands() -> list[list[str]]:
    """The `python -m memlm.launch` and `python -m memlm.train -m` commands of docs/launch.md's bash blocks,
    as argument lists after `python -m` (continuation lines joined, comments dropped)."""
    import shlex

    blocks = re.findall(r"^```bash\n(.*?)^```", DOCS.read_text(), flags=re.S | re.M)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    words = [shlex.split(line, comments=True) for line in lines]
    return [w[2:] for w in words if w[:3] in (["python", "-m", "memlm.launch"], ["python", "-m", "memlm.train"])]


def test_every_launch_command_of_the_docs_runs(recorded, tmp_path, monkeypatch, capsys):
    """Slurm commands and sweeps as dry runs, `local` with torchrun recorded instead of run; `...` (the
    run's overrides) becomes the tiny run."""
    monkeypatch.chdir(tmp_path)
    commands = _docs_commands()
    kinds = set()
    for words in commands:
        args = [a for w in words[1:] for a in (TINY if w == "..." else [w])]
        before = len(recorded)
        if words[0] == "memlm.train":
            assert multirun(args) == 0, (words, capsys.readouterr().err)
            kind, started = "train -m", len(recorded) - before
            assert started == len(expand([a for a in args if a != "-m"])[1]) > 1, words  # one process per point
        else:
            kind = args[0]
            if kind in ("slurm", "sweep") and "--dry-run" not in args:
                args.insert(args.index("--"), "--dry-run")
            assert main(args) == 0, (words, capsys.readouterr().err)
            started = len(recorded) - before
            assert started == (kind == "local"), words  # a dry run starts no process
            if kind == "local":
                assert recorded[-1][1:3] == ["-m", "torch.distributed.run"], recorded[-1]
        kinds.add(kind)
    assert kinds == {"local", "slurm", "sweep", "train -m"}, commands


def test_the_docs_error_example_is_the_error(capsys):
    """docs/launch.md shows the error of a world size memory_parallel does not divide, as printed."""
    text = DOCS.read_text()
    shown = text[text.index("$ python -m memlm.launch local --nproc 3"):]
    command, message = shown.split("\n", 1)
    message = " ".join(message[:message.index("```")].split())
    assert main(command.split()[4:]) == 2
    assert " ".join(capsys.readouterr().err.split()) == message
