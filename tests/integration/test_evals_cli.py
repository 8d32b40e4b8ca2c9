"""`python -m memlm.evals` end to end on a tiny trained checkpoint: output
files, options, errors, and the same numbers on 2 ranks as on one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from evals_fixtures import QA_ROWS, train_tiny_run, write_jsonl

from memlm.evals.cli import main


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalrun")
    return train_tiny_run(root / "run", root / "cache")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaldata")
    write_jsonl(root / "nq_open" / "test.jsonl", QA_ROWS)
    write_jsonl(root / "ppl" / "test.jsonl", [{"text": "Ada Lovelace was born in London."}, {"text": "Hi."}])
    return root


def test_cli_end_to_end_synthetic_qa(run_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "memlm.evals", f"checkpoint={run_dir}", "tasks=[synthetic_qa]",
                           "limit=4"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (report_path,) = (run_dir / "evals" / "cli").glob("2_*.json")  # its own file, beside the run's evals/2.json
    report = json.loads(report_path.read_text())
    assert report["step"] == 2 and report["checkpoint"].endswith("step_00000002")
    result = report["results"]["synthetic_qa"]
    assert result["n"] == 4 and 0.0 <= result["exact_match"] <= result["f1"] <= 1.0
    by_phrasing = report["by_phrasing"]["synthetic_qa"]  # every question's template, counted once
    assert sum(g["n"] for g in by_phrasing.values()) == 4 and result["phrasings"] == len(by_phrasing)
    answered = sum(g["exact_match"] >= 0.5 for g in by_phrasing.values())
    assert result["phrasings_em50"] == answered / len(by_phrasing)
    assert report["tasks"]["synthetic_qa"]["num_fewshot"] == 5
    table = report_path.with_suffix(".md").read_text()
    # the console has the per-task table; the file adds exact match per phrasing
    console, per_phrasing = table.split("\n| task | phrasing |")
    assert "| synthetic_qa | 5 | 4 | exact_match |" in console and console in proc.stdout
    assert per_phrasing and "| task | phrasing |" not in proc.stdout
    assert "[eval] done: step 2" in proc.stdout and "synthetic_qa exact_match" in proc.stdout


def test_cli_out_file_several_tasks_and_samples(run_dir, data_dir, tmp_path, capsys):
    out = tmp_path / "res" / "r.json"
    rc = main([f"checkpoint={run_dir}/checkpoints/latest", f"data_dir={data_dir}", "tasks=[nq_open,ppl]",
               "num_fewshot=1", "limit=2", "max_new_tokens=8", f"out={out}", "log_samples=true"])
    assert rc == 0
    results = json.loads(out.read_text())["results"]
    assert results["nq_open"]["n"] == 2 and results["ppl"]["n"] == 2 and results["ppl"]["bits_per_byte"] > 0
    assert (tmp_path / "res" / "r.md").is_file()
    samples = [json.loads(line) for line in (tmp_path / "res" / "r_samples.jsonl").read_text().splitlines()]
    assert [s["task"] for s in samples] == ["nq_open", "nq_open", "ppl", "ppl"]
    assert samples[0]["question"] == QA_ROWS[1]["question"]  # QA_ROWS[0] is the shot


def test_cli_help_and_bad_input(run_dir, data_dir, tmp_path, capsys):
    assert main(["--help"]) == 0
    assert "checkpoint=<path>" in capsys.readouterr().out
    cases = [
        (["tasks=[synthetic_qa]"], "checkpoint"),
        ([f"checkpoint={run_dir}", "tasks=[squad]"], "eval.tasks='squad': one of: nq_open"),
        ([f"checkpoint={run_dir}"], "tasks=[nq_open,mmlu]"),
        ([f"checkpoint={run_dir}", "tasks=[synthetic_qa]", "out=x.txt"], "a path ending in .json"),
        ([f"checkpoint={run_dir}", "tasks=[synthetic_qa]", "limit=-1"], "eval.limit=-1"),
        ([f"checkpoint={run_dir}", "tasks"], "key=value"),
        ([f"checkpoint={run_dir}", "eval=big"], "configs/eval/"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    # A task file that is not there is a fault of what was read (TaskDataError): exit 1, as from
    # memlm.train and memlm.launch (docs/errors.md).
    assert main([f"checkpoint={run_dir}", "tasks=[mmlu]", f"data_dir={data_dir}"]) == 1
    assert "mmlu/test" in capsys.readouterr().err
    # So is a checkpoint that is not there, as from memlm.hf.export, memlm.generate and slot_usage.
    assert main([f"checkpoint={tmp_path / 'nothing'}", "tasks=[synthetic_qa]"]) == 1
    assert f"no checkpoint at {tmp_path / 'nothing'}" in capsys.readouterr().err


def test_cli_eval_run_takes_the_runs_own_eval_settings(run_dir, tmp_path, capsys):
    import shutil

    import yaml

    from memlm.checkpoint.folder import seal_meta

    # A copy of the run whose saved eval settings differ from the CLI's defaults (5 shots, 32 new tokens).
    run = Path(shutil.copytree(run_dir, tmp_path / "run"))
    meta_path = next((run / "checkpoints").glob("step_*")) / "meta.json"
    meta = json.loads(meta_path.read_text())
    saved = yaml.safe_load(meta["config"])
    saved["eval"].update(num_fewshot=2, max_new_tokens=7)
    # seal_meta: meta.json carries its own crc32, so an edit must be resealed to load.
    meta_path.write_text(json.dumps(seal_meta({**meta, "config": yaml.safe_dump(saved)})))
    out = tmp_path / "r.json"
    # The run's own settings, the task list and limit from the command line.
    assert main([f"checkpoint={run}", "eval=run", "tasks=[synthetic_qa]", "limit=3", f"out={out}"]) == 0
    report = json.loads(out.read_text())
    assert (report["config"]["num_fewshot"], report["config"]["max_new_tokens"], report["config"]["limit"]) == (2, 7, 3)
    assert report["tasks"]["synthetic_qa"]["num_fewshot"] == 2
    assert main([f"checkpoint={run}", "eval=run", "tasks=[synthetic_qa]", "limit=3", "num_fewshot=1",
                 f"out={out}", "replace=true"]) == 0
    assert json.loads(out.read_text())["tasks"]["synthetic_qa"]["num_fewshot"] == 1
    capsys.readouterr()
    assert main([f"checkpoint={run_dir}", "eval=run", "tasks=[synthetic_qa]", "no_such_key=1"]) == 2
    assert "no_such_key" in capsys.readouterr().err


def test_cli_export_folder_needs_out(run_dir, tmp_path, capsys):
    from memlm.run.export import export

    folder = export(run_dir / "checkpoints" / "latest", tmp_path / "export")
    assert main([f"checkpoint={folder}", "eval=run", "tasks=[synthetic_qa]"]) == 2
    assert "eval='run': a run checkpoint" in capsys.readouterr().err
    assert main([f"checkpoint={folder}", "tasks=[synthetic_qa]", "limit=2"]) == 2
    assert "out=''" in capsys.readouterr().err
    assert main([f"checkpoint={folder}", "tasks=[synthetic_qa]", "limit=2", f"out={tmp_path / 'e.json'}"]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["results"]["synthetic_qa"]["n"] == 2
    # The export records the run's corpus (memlm_data.json): the same questions and numbers as the run.
    args = ["tasks=[synthetic_qa]", "limit=4", "num_fewshot=1", "log_samples=true"]
    assert main([f"checkpoint={folder}", *args, f"out={tmp_path / 'export.json'}"]) == 0
    assert main([f"checkpoint={run_dir}", *args, f"out={tmp_path / 'run.json'}"]) == 0
    on_export, on_run = (json.loads((tmp_path / f"{n}.json").read_text())["results"] for n in ("export", "run"))
    assert on_export == on_run
    assert (tmp_path / "export_samples.jsonl").read_text() == (tmp_path / "run_samples.jsonl").read_text()


def test_gathered_records_come_back_in_dataset_order(monkeypatch):
    from memlm.evals import harness

    examples = list(range(7))
    shards = [examples[r::3] for r in range(3)]  # rank r holds r::3: uneven (3, 2, 2)

    def fake_all_gather(parts, mine):
        parts[:] = shards

    monkeypatch.setattr(harness.dist, "all_gather_object", fake_all_gather)
    assert harness.gather_records(shards[1], 3) == examples


@pytest.mark.slow
def test_two_ranks_give_the_one_rank_numbers(run_dir, data_dir, tmp_path):
    from distributed_workers import run_ranks
    from evals_fixtures import cli_rank_worker

    args = [f"checkpoint={run_dir}", f"data_dir={data_dir}", "tasks=[synthetic_qa,nq_open,ppl]", "limit=5",
            "num_fewshot=1", "max_new_tokens=8", "log_samples=true"]
    assert main([*args, f"out={tmp_path / 'one.json'}"]) == 0
    run_ranks(cli_rank_worker, 2, [*args, f"out={tmp_path / 'two.json'}"])
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert two["world_size"] == 2
    assert two["results"] == one["results"]
    assert (tmp_path / "two_samples.jsonl").read_text() == (tmp_path / "one_samples.jsonl").read_text()


def test_run_keeps_its_tokenizer_so_a_lost_corpus_cache_does_not_matter(tmp_path_factory):
    import filecmp
    import shutil

    from memlm.run.load import load_model

    root = tmp_path_factory.mktemp("tokrun")
    run = train_tiny_run(root / "run", root / "cache")
    (cached,) = (root / "cache").glob("synthetic-*/tokenizer-v*.model")
    assert filecmp.cmp(run / "tokenizer.model", cached, shallow=False)
    shutil.rmtree(root / "cache")  # e.g. a newer memlm regenerates it differently, or it was cleaned
    assert load_model(run).tokenizer_path == str(run / "tokenizer.model")
