"""Faults end every command the same way: one `error: ...` line on stderr and the
kind's exit code (docs/errors.md), never a traceback (memlm.errors.entry_point).

Before: the train CLI let NonFiniteLossError out as a traceback; `memlm.evals` and
`memlm.generate` did the same for an export with a missing or corrupt file;
`python -m memlm.train.slot_usage` for a corrupt checkpoint; and one damaged
checkpoint exited 1 from train and export but 2 from evals and generate.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import pytest
from evals_fixtures import train_tiny_run
from fault_injection import corrupt_shard

CHECKPOINT = "step_00000002"
FAULT_EXIT, USAGE_EXIT = 1, 2  # docs/errors.md


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A tiny run, a copy of its checkpoint with a corrupt shard, and its export
    with a weight file missing, one with memlm_config.json not JSON, one with a
    weight file that is not safetensors."""
    from memlm.run.export import export

    root = tmp_path_factory.mktemp("faults")
    run = train_tiny_run(root / "run", root / "cache")
    good = run / "checkpoints" / CHECKPOINT
    bad = root / "bad_run" / "checkpoints" / CHECKPOINT
    shutil.copytree(good, bad)
    shutil.copy(run / "tokenizer.model", root / "bad_run" / "tokenizer.model")
    corrupt_shard(bad)
    exported = export(good, root / "export")
    broken = {}
    for name, damage in [("missing_weights", lambda d: (d / "model.safetensors").unlink()),
                         ("bad_json", lambda d: (d / "memlm_config.json").write_text("{not json")),
                         ("bad_weights", lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64))]:
        broken[name] = root / name
        shutil.copytree(exported, broken[name])
        damage(broken[name])
    return {"run": run, "good": good, "bad": bad, "root": root, **broken}


def run_main(module: str, argv: list[str], capsys) -> tuple[int, str]:
    """A command's main(argv) as a shell runs it: (exit status, stderr); an exception
    escaping main is what a user would see as a traceback, and fails the test."""
    main = importlib.import_module(module).main
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def one_error_line(err: str) -> str:
    """The one `error:` line, last on stderr (progress lines, e.g. memlm.generate's, may come before)."""
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in err, err
    return errors[0]


# ------------------------------------------------------------------ the cases
def test_train_cli_on_a_loss_that_stays_non_finite_prints_one_line(tmp_path, capsys):
    code, err = run_main("memlm.train.cli", [
        "model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2", "optim.warmup=0", "data.kind=random",
        "logging.wandb.mode=disabled", "checkpoint.at_end=false", "val_batches=0", "memory=memplus",
        "memory.n_keys=8", "memory.knn=4", "memory.eval_knn=4", "memory.k_dim=16", "memory.heads=2",
        "memory.layers=[1]", "optim.lr=1e6", "max_nonfinite_steps=3", "steps=20", "logging.every=1000",
        f"dump_dir={tmp_path}"], capsys)
    line = one_error_line(err)
    assert code == FAULT_EXIT
    assert "3 consecutive non-finite" in line and "Lower optim.lr" in line


@pytest.mark.parametrize("damage", ["missing_weights", "bad_json", "bad_weights"])
def test_evals_on_a_broken_export_prints_one_line(files, damage, capsys):
    export = files[damage]
    code, err = run_main("memlm.evals.cli", [f"checkpoint={export}", "tasks=[synthetic_qa]", "limit=2",
                                             f"out={files['root'] / f'{damage}.json'}"], capsys)
    line = one_error_line(err)
    assert code == FAULT_EXIT and str(export) in line, line


@pytest.mark.parametrize("damage", ["missing_weights", "bad_json", "bad_weights"])
def test_generate_on_a_broken_export_prints_one_line(files, damage, capsys):
    export = files[damage]
    code, err = run_main("memlm.generate.cli", [str(export), "--prompt", "x", "--max-new-tokens", "2"],
                         capsys)
    line = one_error_line(err)
    assert code == FAULT_EXIT and str(export) in line, line


def test_slot_usage_on_a_corrupt_checkpoint_prints_one_line(files, capsys):
    code, err = run_main("memlm.train.slot_usage", [str(files["bad"]), "--batches", "1"], capsys)
    line = one_error_line(err)
    assert code == FAULT_EXIT and "is corrupted" in line, line


def _corrupt_checkpoint_argv(files) -> dict[str, list[str]]:
    bad, root = files["bad"], files["root"]
    return {
        "memlm.train.cli": ["model.vocab_size=512", "model.max_seq_len=256", "data=synthetic", "data.seq_len=64",
                            "data.micro_batch=2", f"data.cache_dir={root / 'cache'}", "data.synthetic.people=40",
                            "steps=3", "logging.wandb.mode=disabled", f"dump_dir={root / 'resumed'}",
                            f"resume={bad}"],
        "memlm.evals.cli": [f"checkpoint={bad}", "tasks=[synthetic_qa]", "limit=2"],
        "memlm.generate.cli": [str(bad), "--prompt", "x", "--max-new-tokens", "2"],
        "memlm.run.export": [str(bad), str(root / "never")],
        "memlm.train.slot_usage": [str(bad), "--batches", "1"],
    }


def test_one_corrupt_checkpoint_is_the_same_exit_code_from_every_command(files, capsys):
    codes = {}
    for module, argv in _corrupt_checkpoint_argv(files).items():
        code, err = run_main(module, argv, capsys)
        line = one_error_line(err)
        assert "is corrupted" in line, (module, line)
        codes[module] = code
    assert set(codes.values()) == {FAULT_EXIT}, codes


def test_a_missing_shard_is_one_line(files, tmp_path, capsys):
    """A shard file the manifest names is gone: the reader names it (memlm.data.shards.load_split)."""
    from memlm.data.config import SourceConfig
    from memlm.data.prepare import prepare
    from memlm.data.shards import MANIFEST, load_split, read_manifest
    from memlm.errors import entry_point

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(f'{{"text": "document {i} about things"}}\n' for i in range(20)))
    prepare([SourceConfig(name="a", path=str(corpus))], str(files["run"] / "tokenizer.model"), str(tmp_path / "s"),
            workers=1)
    manifest = read_manifest(str(tmp_path / "s"))
    missing = tmp_path / "s" / "a" / manifest["sources"]["a"]["shards"]["train"][0]["bin"]
    missing.unlink()

    @entry_point
    def main(argv=None):
        load_split(str(tmp_path / "s"), manifest, "a", "train")
        return 0

    capsys.readouterr()
    assert main() == USAGE_EXIT
    assert f"{missing}, named by its {MANIFEST}, is missing" in one_error_line(capsys.readouterr().err)


# ------------------------------------------------------------------ every main, every kind
def _bad_jsonl(root: Path) -> Path:
    path = root / "bad.jsonl"
    path.write_text('{"text": "a fine line"}\n{"text": \n')
    return path


def _bad_task_dir(root: Path) -> Path:
    """An eval data_dir whose nq_open file has a line that is not JSON."""
    folder = root / "evals_data" / "nq_open"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "test.jsonl").write_text('{"question": "q?", "answer": ["a"]}\n{not json\n')
    return root / "evals_data"


def _every_main(files) -> list[tuple[str, list[str], int, str]]:
    """(module, argv, exit code, a piece of the line): a real fault for every main."""
    root = files["root"]
    empty = root / "empty"
    empty.mkdir(exist_ok=True)
    bad_jsonl = _bad_jsonl(root)
    tokenizer = str(files["run"] / "tokenizer.model")
    return [
        ("memlm.train.cli", ["stpes=1"], USAGE_EXIT, "unknown key stpes"),
        ("memlm.evals.cli", [f"checkpoint={files['bad_json']}", "tasks=[synthetic_qa]",
                             f"out={root / 'x.json'}"], FAULT_EXIT, "bad_json/memlm_config.json has 9 bytes"),
        ("memlm.generate.cli", [str(files["missing_weights"]), "--prompt", "x"], FAULT_EXIT, "is missing"),
        ("memlm.run.export", [str(root / "nowhere"), str(root / "never")], FAULT_EXIT, "cannot export"),
        ("memlm.train.slot_usage", [str(files["good"]), "--batches", "0"], USAGE_EXIT, "--batches"),
        ("memlm.data.prepare", ["--source", f"web={bad_jsonl}", "--tokenizer", tokenizer, "--out",
                                str(root / "shards"), "--workers", "1"], FAULT_EXIT, "bad.jsonl:2"),
        ("memlm.data.tokenizer", ["train", "--input", str(bad_jsonl), "--out", str(root / "t.model"),
                                  "--vocab-size", "300"], FAULT_EXIT, "bad.jsonl:2"),
        ("memlm.data.synthetic", ["--people", "0", "--out", str(root / "s")], USAGE_EXIT, "people"),
        ("memlm.data.facts", ["--entities", "0", "--out", str(root / "f")], USAGE_EXIT, "entities"),
        ("memlm.data.continual", ["--rounds", "0", "--out", str(root / "c")], USAGE_EXIT, "rounds"),
        ("memlm.launch.cli", ["local", "--nproc", "1", "--", "model.vocab_size=512", "data=synthetic",
                              f"data.cache_dir={root / 'cache'}", "data.synthetic.people=40",
                              "eval.after_training=true", "eval.tasks=[nq_open]",
                              f"eval.data_dir={_bad_task_dir(root)}", f"dump_dir={root / 'launched'}"],
         FAULT_EXIT, "test.jsonl"),
        ("memlm.launch.cli", ["local", "--nproc", "0"], USAGE_EXIT, "--nproc"),
        ("memlm.plan.cli", ["model=nope"], USAGE_EXIT, "model='nope'"),
        ("memlm.plan.describe", ["model=nope"], USAGE_EXIT, "model='nope'"),
        ("memlm.studies.ablation_report", [str(empty), "--doc", str(root / "r.md"), "--plot", ""], FAULT_EXIT, ""),
        ("memlm.studies.capacity_report", [str(empty)], FAULT_EXIT, "no finished run"),
        ("memlm.studies.continual_report", [str(empty)], FAULT_EXIT, "no base_s"),
        ("memlm.studies.engram_where", [str(files["good"]), str(bad_jsonl), "--n", "0"], USAGE_EXIT, "--n"),
        ("memlm.studies.engram_phrasing", [str(empty)], FAULT_EXIT, "no finished run folder"),
        ("memlm.studies.finetune_recipe", ["--render-only", "--record", str(empty / "record.json"), "--doc", ""],
         FAULT_EXIT, "no record at"),
        ("memlm.launch.demo_record", ["--commit", "no-such-commit", "--out", str(root / "demo_record")],
         FAULT_EXIT, "--commit no-such-commit: not a commit of"),
    ]


def test_every_main_ends_a_fault_with_one_line_and_its_code(files, capsys, monkeypatch, tmp_path):
    seen = set()
    for module, argv, expected, piece in _every_main(files):
        code, err = run_main(module, argv, capsys)
        line = one_error_line(err)
        assert code == expected and piece in line, (module, argv, code, line)
        seen.add(module)
    # The demo refuses a folder it did not make (DemoFolderError), before any work.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "demo" / "mine.txt").parent.mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "mine.txt").write_text("not the demo's")
    code, err = run_main("memlm.launch.demo", ["dump_dir=runs/demo", "name=demo"], capsys)
    assert code == USAGE_EXIT and "was not made by the demo" in one_error_line(err)
    # The continual study's data step meets a bad file; lm-eval's command loads a broken export.
    from memlm.data.stats import DataError

    def bad_data(*args, **kwargs):
        raise DataError("facts_a.jsonl:3", "bad_json", "Expecting value")

    monkeypatch.setattr("memlm.data.continual.write_study", bad_data)
    code, err = run_main("memlm.launch.continual_study", ["--stage", "base"], capsys)
    assert code == FAULT_EXIT and "facts_a.jsonl:3" in one_error_line(err)

    def broken_export():
        from memlm.hf.pretrained import read_config

        read_config(files["bad_json"])
        raise AssertionError("read_config read a file that is not JSON")

    monkeypatch.setattr("lm_eval.__main__.cli_evaluate", broken_export)
    code, err = _lm_eval(capsys)
    assert code == FAULT_EXIT and "is not readable JSON" in one_error_line(err)
    # `python -m memlm.train -m` (Hydra's multirun flag) is the train command's other entry.
    from memlm.launch.multirun import multirun

    capsys.readouterr()
    assert multirun(["-m"]) == USAGE_EXIT and "needs overrides" in one_error_line(capsys.readouterr().err)
    seen |= {"memlm.launch.demo", "memlm.launch.continual_study", "memlm.evals.lm_eval"}
    assert seen == set(all_mains()), set(all_mains()) ^ seen


def _lm_eval(capsys) -> tuple[int, str]:
    """lm-eval's command takes its arguments from sys.argv."""
    from memlm.evals.lm_eval import main

    capsys.readouterr()
    code = main()
    return code, capsys.readouterr().err


def all_mains() -> list[str]:
    """Every module of memlm with a `def main` (bench/ is developer tooling, not a command)."""
    import memlm

    package = Path(memlm.__file__).parent
    found = []
    for top in sorted(p for p in package.iterdir() if p.is_dir() and (p / "__init__.py").is_file()):
        if top.name in ("tests", "bench"):
            continue
        for path in sorted(top.rglob("*.py")):
            if "\ndef main(" in path.read_text():
                found.append(".".join(("memlm", *path.relative_to(package).with_suffix("").parts)))
    return found


def test_every_main_is_wrapped_by_entry_point():
    unwrapped = [m for m in all_mains() if not hasattr(importlib.import_module(m).main, "__wrapped__")]
    assert not unwrapped, f"mains without memlm.errors.entry_point: {unwrapped}"
    assert len(all_mains()) == 23, all_mains()


# ------------------------------------------------------------------ the wrapper, kind by kind
def _kinds():
    from memlm.checkpoint.folder import CheckpointError
    from memlm.checkpoint.run_lock import RunLockedError
    from memlm.config.keys import UnknownKeyError
    from memlm.data.stats import DataError
    from memlm.distributed.env import PeerLostError
    from memlm.errors import ConfigError
    from memlm.evals.formats import TaskDataError
    from memlm.files import OutputError
    from memlm.hf.pretrained import ExportError
    from memlm.launch.demo import DemoFolderError
    from memlm.launch.validate import LaunchError
    from memlm.studies.ablation_report import ReportError
    from memlm.train.step_guard import NonFiniteLossError

    return [(ConfigError("steps", -1, "an integer >= 1"), USAGE_EXIT),
            (UnknownKeyError("stpes", "1", ["steps"], []), USAGE_EXIT),
            (LaunchError("--nproc 0: must be an integer >= 1"), USAGE_EXIT),
            (DataError("a.jsonl:2", "bad_json", "Expecting value"), FAULT_EXIT),
            (TaskDataError("nq_open: missing"), FAULT_EXIT),
            (CheckpointError("step_2 is corrupted"), FAULT_EXIT),
            (RunLockedError("runs/x is held"), FAULT_EXIT),
            (NonFiniteLossError("3 consecutive non-finite losses"), FAULT_EXIT),
            (ExportError("x/model.safetensors is missing"), FAULT_EXIT),
            (OutputError("runs holds the checkpoint it exports"), USAGE_EXIT),
            (DemoFolderError("runs/demo was not made by the demo"), USAGE_EXIT),
            (ReportError("no finished run"), FAULT_EXIT),
            (PeerLostError("rank 0 did not meet it"), FAULT_EXIT)]


@pytest.mark.parametrize("debug", ["", "1"])
def test_each_kind_is_one_line_and_its_documented_code(capsys, monkeypatch, debug):
    from memlm.errors import MemlmError, entry_point

    monkeypatch.setenv("MEMLM_DEBUG", debug)
    for err, code in _kinds():
        assert isinstance(err, MemlmError) and err.exit_code == code

        @entry_point
        def main(argv=None, err=err):
            raise err

        capsys.readouterr()
        assert main([]) == code
        text = capsys.readouterr().err
        assert text.strip().splitlines()[-1] == f"error: {err}"
        assert ("Traceback" in text) == bool(debug), text


def test_under_torchrun_rank_0_speaks_for_the_same_error_and_each_rank_for_its_own(capsys, monkeypatch):
    from memlm.data.stats import DataError
    from memlm.errors import ConfigError, report

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    report(ConfigError("steps", -1, "an integer >= 1"))
    assert capsys.readouterr().err == ""  # rank 0 says it
    report(DataError("a.jsonl:2", "bad_json", "Expecting value"))
    assert capsys.readouterr().err.startswith("error: rank 1: a.jsonl:2: bad json")


def test_docs_list_every_kind():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "errors.md").read_text()
    for err, code in _kinds():
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{type(err).__name__}`")), None)
        assert row is not None, f"docs/errors.md has no row for {type(err).__name__}"
        assert f"| {code} |" in row, row


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
