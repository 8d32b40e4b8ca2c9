"""Files change only when something happens (issue 42, item 3).

A finished run's command run again, with other settings, trains nothing and
leaves every file of its folder byte for byte as it was (sha256 of every
file: config.yaml, metrics.jsonl, summary.json, evals, the kept tokenizer,
checkpoints, the released lock). An export into a folder of the user's is
refused, with or without `--overwrite`; into an export of another run,
refused unless `--overwrite`; a re-export keeps the files the user added
(issue 54: tests/integration/test_no_data_lost.py has the rest). Replacing an
export writes the new one beside it and swaps at the end, so an export
killed midway leaves the previous one whole and loadable.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli import run_main
from launch_helpers import TINY

from memlm.files import OutputError
from memlm.hf import from_pretrained
from memlm.hf.pretrained import CONFIG_NAME
from memlm.run.export import export, main

BASE = [o for o in TINY if not o.startswith("steps=")]
# A run that writes every kind of file a run folder holds: the synthetic corpus' tokenizer (kept
# in the folder), a checkpoint per step, metrics, evaluations after training, the summary.
FINISHED = [*BASE, "model.vocab_size=512", "data=synthetic", "data.synthetic.people=20", "steps=2",
            "logging.every=1", "checkpoint.every=1", "checkpoint.keep=2", "eval.after_training=true",
            "eval.tasks=[synthetic_qa]", "eval.limit=4", "eval.num_fewshot=1"]


def hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("finished")
    cache = f"data.cache_dir={root / 'cache'}"
    from memlm.train.cli import main as train

    assert train([*FINISHED, cache, f"dump_dir={root / 'run'}"]) == 0
    return root / "run"


@pytest.fixture
def run_dir(finished, tmp_path) -> Path:
    """A private copy of the finished run."""
    return Path(shutil.copytree(finished, tmp_path / "run"))


@pytest.mark.parametrize("other", [
    # other settings; TensorBoard would add an event file, a new eval task a result file
    ["optim.lr=1e-2", "seed=7", "logging.tensorboard=true", "eval.limit=2"],
    # back to an earlier checkpoint, at its step: later checkpoints and metrics rows stay where they are
    ["steps=1", "resume={run}/checkpoints/step_00000001"],
])
def test_a_finished_runs_command_with_other_settings_changes_no_file(finished, run_dir, capsys, other):
    before = hashes(run_dir)
    assert {"config.yaml", "metrics.jsonl", "summary.json", "evals/2.json", "tokenizer.model", "run.lock",
            "checkpoints/latest", "checkpoints/step_00000002/meta.json"} <= set(before)
    cache = f"data.cache_dir={finished.parent / 'cache'}"
    overrides = [o.format(run=run_dir) for o in other]
    result = run_main("memlm.train", *FINISHED, cache, *overrides, f"dump_dir={run_dir}", capsys=capsys)
    assert result.returncode == 0, result.stderr
    assert hashes(run_dir) == before
    assert "nothing to train" in result.stdout
    # The console names the settings the folder does not record (one line).
    (line,) = [x for x in result.stdout.splitlines() if "differ from" in x]
    for override in overrides:
        assert override.split("=")[0] in line


# ---------------------------------------------------------------- export
@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    """A tiny dense run with no tokenizer (its exports are quick) and a checkpoint at steps 1 and 2."""
    from memlm.train.cli import main as train

    root = tmp_path_factory.mktemp("small")
    assert train([*BASE, "steps=2", "checkpoint.every=1", f"dump_dir={root / 'run'}"]) == 0
    return root / "run"


def test_export_over_a_users_folder_is_refused(small_run, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": true}\n')
    before = hashes(mine)
    for overwrite in ([], ["--overwrite"]):  # not an export: never replaced
        assert main([str(small_run), str(mine), *overwrite]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(mine) in err[0] and "not a memlm export" in err[0]
        assert hashes(mine) == before
    # An export of another run is no earlier export of this one: --overwrite replaces it.
    other = export(small_run, tmp_path / "other")
    mark = json.loads((other / CONFIG_NAME).read_text())
    (other / CONFIG_NAME).write_text(json.dumps({**mark, "run": str(tmp_path / "elsewhere")}))
    with pytest.raises(OutputError, match="--overwrite"):
        export(small_run, other)
    assert main([str(small_run), str(other), "--overwrite"]) == 0
    assert json.loads((other / CONFIG_NAME).read_text())["run"] == str(small_run.resolve())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "other"]


def test_export_of_the_same_run_again_replaces_it(small_run, tmp_path):
    out = export(small_run, tmp_path / "export")
    (out / "notes.txt").write_text("the user's")
    export(small_run, out)
    assert (out / "notes.txt").read_text() == "the user's"  # kept: not the export's to delete
    assert [p.name for p in tmp_path.iterdir()] == ["export"]  # no new or old copy left beside it


KILLED_EXPORT = """
import os, signal, sys
import memlm.run.export as export
export.write_data_config = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # after the weights
sys.exit(export.main(sys.argv[1:]))
"""


def test_an_export_killed_midway_leaves_the_previous_one_loadable(small_run, tmp_path):
    out = export(small_run / "checkpoints" / "step_00000001", tmp_path / "export")
    before = hashes(out)
    tokens = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = from_pretrained(out)(tokens)
    # Exporting the newer checkpoint (other weights) over it, killed while writing.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", KILLED_EXPORT, str(small_run), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert hashes(out) == before
    with torch.no_grad():
        assert torch.equal(from_pretrained(out)(tokens), expected)
    # The next export replaces it and removes what the killed one left beside it.
    assert len(list(tmp_path.iterdir())) == 2
    export(small_run, out)
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    assert json.loads((out / CONFIG_NAME).read_text())["step"] == 2
