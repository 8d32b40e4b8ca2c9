"""A new user's first hour (issue 31): nothing they made is deleted or
overwritten without asking, and every mistake is one line on stderr.

Each command runs as a user types it (a subprocess), and the files a
failing command might have touched are compared byte for byte. Commands
that only refuse a config (exit 2 before anything runs) call the CLI's
`main(argv)` in-process (helpers/cli.py): the same code path, without an
interpreter start.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli import run_main
from evals_fixtures import QA_ROWS, write_jsonl
from launch_helpers import TINY

from memlm.hf.pretrained import write_manifest
from memlm.launch.demo import MARK, DemoFolderError, claim_folders, mark_finished


def run(module: str, *args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_SILENT="true")
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line(proc) -> str:  # a CompletedProcess or a cli.Result
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, f"stderr is {len(lines)} lines:\n{proc.stderr[-3000:]}"
    return lines[0]


# ---------------------------------------------------------------- the demo's folders
def test_demo_refuses_a_run_folder_it_did_not_make(tmp_path):
    user_run = tmp_path / "runs" / "mine"
    (user_run / "checkpoints" / "step_00000100").mkdir(parents=True)
    (user_run / "checkpoints" / "step_00000100" / "meta.json").write_text("{}")
    (user_run / "config.yaml").write_text("memory:\n  kind: memplus\n")
    before = snapshot(user_run)
    proc = run("memlm.launch.demo", "name=mine", cwd=tmp_path)
    assert proc.returncode == 2  # an OutputError: the name is the fix
    line = one_line(proc)
    assert "runs/mine exists and was not made by the demo" in line and "name=" in line
    assert snapshot(user_run) == before
    assert not (tmp_path / "exports").exists()


def test_demo_refuses_an_export_it_did_not_write(tmp_path):
    export = tmp_path / "exports" / "demo"
    export.mkdir(parents=True)
    (export / "model.safetensors").write_bytes(b"user weights")
    with pytest.raises(DemoFolderError, match="exports/demo exists and was not written by the demo"):
        claim_folders(tmp_path / "runs" / "demo", export)
    assert (export / "model.safetensors").read_bytes() == b"user weights"


def test_demo_replaces_only_what_it_marked(tmp_path, capsys):
    dump, export = tmp_path / "runs" / "demo", tmp_path / "exports" / "demo"
    claim_folders(dump, export)  # a first demo: marks its folder
    assert json.loads((dump / MARK).read_text()) == {"export": str(export)}
    (dump / "metrics.jsonl").write_text("{}\n")
    export.mkdir(parents=True)
    (export / "model.safetensors").write_bytes(b"demo weights")
    write_manifest(export)  # as the export writes it
    mark_finished(dump, export)  # as the demo records its files when it ends
    claim_folders(dump, export)  # a second demo: both replaced
    assert "replacing the previous demo run" in capsys.readouterr().out
    assert not (dump / "metrics.jsonl").exists() and not export.exists() and (dump / MARK).is_file()
    other = tmp_path / "exports" / "elsewhere"  # the mark names another export: this one is not the demo's
    other.mkdir()
    (other / "x").write_text("user")
    with pytest.raises(DemoFolderError):
        claim_folders(dump, other)


# ---------------------------------------------------------------- a failing command
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished Memory+ run (checkpoint, config.yaml, metrics, summary, released lock)."""
    root = tmp_path_factory.mktemp("finished")
    proc = run("memlm.train", *TINY, "memory=memplus", "memory.layers=[1]", "memory.n_keys=16", "memory.knn=4",
               "memory.eval_knn=4", "memory.k_dim=32", "memory.heads=2", f"dump_dir={root / 'run'}", cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "run"


@pytest.mark.parametrize("bad", [
    # a data path that does not exist, with the default (dense) memory config
    ["data.kind=raw", "data.tokenizer=/nonexistent/tok.model", "data.sources=[{path: /nonexistent/x.jsonl}]"],
    # a model the checkpoint does not fit (resume=auto is the default)
    ["memory=memplus", "memory.layers=[1]", "memory.n_keys=32", "memory.knn=4", "memory.eval_knn=4",
     "memory.k_dim=32", "memory.heads=2", "steps=8"],
])
def test_a_failing_command_leaves_the_run_folder_byte_identical(finished_run, tmp_path, bad):
    before = snapshot(finished_run)
    proc = run("memlm.train", *TINY, *bad, f"dump_dir={finished_run}", cwd=tmp_path)
    assert proc.returncode in (1, 2)
    line = one_line(proc)
    assert line.startswith("error: ")
    assert snapshot(finished_run) == before


def test_the_same_command_again_resumes_instead_of_starting_over(finished_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    proc = run("memlm.train", *TINY, "memory=memplus", "memory.layers=[1]", "memory.n_keys=16", "memory.knn=4",
               "memory.eval_knn=4", "memory.k_dim=32", "memory.heads=2", "steps=6", f"dump_dir={run_dir}",
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 4" in proc.stdout
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == sorted(set(steps)) and steps[-1] == 6
    assert not list((run_dir / "checkpoints").glob("abandoned_*"))


# ---------------------------------------------------------------- evaluations after the fact
def test_evals_without_out_keep_the_training_time_results(tmp_path):
    proc = run("memlm.train", *TINY, "model.vocab_size=512", "model.max_seq_len=256", "data=synthetic",
               "data.seq_len=64", f"data.cache_dir={tmp_path / 'cache'}", "data.synthetic.people=40", "steps=2",
               "eval.after_training=true", "eval.tasks=[synthetic_qa]", "eval.limit=6", "eval.num_fewshot=1",
               f"dump_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained = tmp_path / "run" / "evals" / "2.json"
    before = trained.read_bytes()
    proc = run("memlm.evals", f"checkpoint={tmp_path / 'run'}", "tasks=[synthetic_qa]", "limit=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert trained.read_bytes() == before
    (posthoc,) = (tmp_path / "run" / "evals" / "cli").glob("2_*.json")
    assert json.loads(posthoc.read_text())["results"]["synthetic_qa"]["n"] == 2
    # out= naming an existing file is refused unless replace=true
    proc = run("memlm.evals", f"checkpoint={tmp_path / 'run'}", "tasks=[synthetic_qa]", "limit=2",
               f"out={trained}", cwd=tmp_path)
    assert proc.returncode == 2 and "replace=true" in one_line(proc)
    assert trained.read_bytes() == before


# ---------------------------------------------------------------- one line for every mistake
def test_a_malformed_eval_file_under_after_training_is_one_line(tmp_path):
    data_dir = tmp_path / "evals_data"
    write_jsonl(data_dir / "nq_open" / "test.jsonl", QA_ROWS)
    with (data_dir / "nq_open" / "test.jsonl").open("a") as f:
        f.write("{not json\n")
    proc = run("memlm.train", *TINY, "model.vocab_size=512", "data=synthetic", f"data.cache_dir={tmp_path / 'c'}",
               "data.synthetic.people=20", "eval.after_training=true", "eval.tasks=[nq_open]",
               f"eval.data_dir={data_dir}", f"dump_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 1
    line = one_line(proc)
    assert "test.jsonl" in line and "line" in line
    assert not (tmp_path / "run").exists()  # refused before the run folder was made
    proc = run("memlm.train", *TINY, "model.vocab_size=512", "data=synthetic", f"data.cache_dir={tmp_path / 'c'}",
               "data.synthetic.people=20", "eval.after_training=true", "eval.tasks=[triviaqa]",
               f"eval.data_dir={data_dir}", f"dump_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode in (1, 2) and "triviaqa" in one_line(proc)


def test_launch_local_refuses_a_bad_data_path_before_torchrun(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proc = run_main("memlm.launch", "local", "--nproc", "2", "--", *TINY, "data.kind=raw",
                    "data.tokenizer=/nonexistent/tok.model", "data.sources=[{path: /nonexistent/x.jsonl}]",
                    f"dump_dir={tmp_path / 'run'}", capsys=capsys)
    assert proc.returncode == 2
    assert one_line(proc) == ("error: invalid config value data.tokenizer='/nonexistent/tok.model': the path of an "
                              "existing sentencepiece .model file")
    assert "torch.distributed.run" not in proc.stdout and not (tmp_path / "run").exists()


@pytest.mark.parametrize("override,expected", [
    ("memory.n_kyes=64", "error: unknown key memory.n_kyes; did you mean memory.n_keys?"),
    ("+memory.n_kyes=64", "error: unknown key memory.n_kyes; did you mean memory.n_keys?"),
    ("optim.lrr=1e-3", "error: unknown key optim.lrr; did you mean optim.lr?"),
    ("stpes=10", "error: unknown key stpes; did you mean steps?"),
])
def test_a_mistyped_key_names_the_key_meant(tmp_path, capsys, monkeypatch, override, expected):
    monkeypatch.chdir(tmp_path)
    proc = run_main("memlm.train", override, capsys=capsys)
    assert proc.returncode == 2 and one_line(proc) == expected


@pytest.mark.parametrize("overrides,key", [
    (["data=synthetic", "data.tokenizer=/nonexistent/tok.model"], "data.tokenizer"),
    (["data.sources=[{path: corpus.jsonl}]"], "data.sources"),  # data=random reads no sources
    (["data=facts", "data.synthetic.people=3"], "data.synthetic"),
    (["data.shards_dir=/data/shards"], "data.shards_dir"),
])
def test_an_override_the_data_kind_would_ignore_is_refused(tmp_path, capsys, monkeypatch, overrides, key):
    monkeypatch.chdir(tmp_path)
    proc = run_main("memlm.train", *TINY, *overrides, f"data.cache_dir={tmp_path / 'c'}",
                    f"dump_dir={tmp_path / 'r'}", capsys=capsys)
    assert proc.returncode == 2
    assert one_line(proc).startswith(f"error: invalid config value {key}=")
    assert not (tmp_path / "r").exists() and not Path("/nonexistent/tok.model").exists()


def test_init_from_a_folder_that_is_no_checkpoint_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "notes").mkdir()
    monkeypatch.chdir(tmp_path)
    for argv in (["memlm.train"], ["memlm.launch", "local", "--nproc", "2", "--"]):
        proc = run_main(*argv, *TINY, f"init_from={tmp_path / 'notes'}", f"dump_dir={tmp_path / 'r'}", capsys=capsys)
        assert proc.returncode == 2
        line = one_line(proc)
        assert "init_from=" in line and "a memlm export" in line and "meta.json is missing" in line
        assert not (tmp_path / "r").exists()
