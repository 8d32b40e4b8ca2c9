"""No command deletes or replaces what it did not write; exports are verified (issue 54, items 1, 2, 8).

Each repro of the issue runs here as its command does (`main(argv)`, exit
status and stderr as a shell sees them), on one tiny Memory+ run:
- `export runs/t2 runs --overwrite` and `export runs/t2 runs/t2 --overwrite`
  are refused (exit 2, one line) and leave every file of `runs/` as it was;
  so are out_dir = any run folder, the checkpoints folder, a folder inside
  the checkpoint;
- a user's MODEL_CARD.md in an earlier export survives a re-export (named),
  and `--overwrite` refuses the folder, naming it;
- every file of an export follows the umask, model.safetensors included;
- 200,000 scrambled bytes in model.safetensors (or an edited config) are an
  error naming the file from every memlm read: from_pretrained, generate,
  evals, init_from.
And every other command that writes files gets the same treatment: evals
`out=`, slot_usage `--out`, the tokenizer, prepare, the demo's folders.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import random
import shutil
from pathlib import Path

import pytest

from memlm.files import folder_manifest
from memlm.hf import from_pretrained
from memlm.hf.pretrained import MANIFEST_NAME, ExportError, write_manifest
from memlm.run.export import export

RUN = ["model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2", "logging.wandb.mode=disabled",
       "model.n_layers=3", "memory=memplus", "memory.layers=[1]", "memory.n_keys=8", "memory.knn=4",
       "memory.eval_knn=4", "memory.heads=2", "memory.k_dim=16"]
FAULT_EXIT, USAGE_EXIT = 1, 2  # docs/errors.md


def hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def run_main(module: str, argv: list[str], capsys) -> tuple[int, str, str]:
    """`python -m <module> argv` in this process: (exit status, stdout, stderr)."""
    main = importlib.import_module(module).main
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def refused(code: int, err: str, *pieces: str) -> None:
    """One `error:` line, exit 2 (an OutputError), naming each piece."""
    lines = err.strip().splitlines()
    assert code == USAGE_EXIT and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    for piece in pieces:
        assert str(piece) in lines[0], (piece, lines[0])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 2-step Memory+ run (no tokenizer: random data)."""
    from memlm.train.cli import main as train

    root = tmp_path_factory.mktemp("trained")
    assert train([*RUN, "steps=2", f"dump_dir={root / 'try'}"]) == 0
    return root / "try"


@pytest.fixture
def runs(trained, tmp_path, monkeypatch) -> Path:
    """A fresh project folder holding runs/try (a copy of the trained run), the working directory."""
    shutil.copytree(trained, tmp_path / "runs" / "try")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "runs"


# ---------------------------------------------------------------- item 1: the target is never a run
def test_export_never_writes_over_its_run_or_a_folder_holding_runs(runs, capsys):
    shutil.copytree(runs / "try", runs / "t2")  # cp -r runs/try runs/t2
    shutil.copytree(runs / "try", Path("elsewhere") / "r1")
    before = hashes(runs.parent)
    checkpoint = Path("runs/t2/checkpoints/step_00000002")
    for argv, named in [
        (["runs/t2", "runs", "--overwrite"], "runs holds the checkpoint it exports"),
        (["runs/t2", "runs/t2", "--overwrite"], "runs/t2 holds the checkpoint it exports"),
        (["runs/t2", checkpoint, "--overwrite"], f"{checkpoint} is the checkpoint it exports"),
        (["runs/t2", "runs/t2/checkpoints", "--overwrite"], "runs/t2/checkpoints holds the checkpoint"),
        (["runs/t2", checkpoint / "export"], "lies inside the checkpoint it exports"),
        (["runs/t2", "runs/try", "--overwrite"], "runs/try is a memlm run folder"),  # another run
        (["runs/t2", "elsewhere", "--overwrite"], "elsewhere holds memlm run folders (r1)"),
    ]:
        code, _, err = run_main("memlm.run.export", argv, capsys)
        refused(code, err, named)
        assert hashes(runs.parent) == before, argv


# ---------------------------------------------------------------- item 2: a re-export keeps the user's files
def test_a_reexport_keeps_the_users_files_and_overwrite_refuses_them(runs, capsys):
    out = export(runs / "try", Path("exports/try"))
    (out / "MODEL_CARD.md").write_text("card\n")  # echo card > exports/try/MODEL_CARD.md
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    code, stdout, err = run_main("memlm.run.export", ["runs/try", "exports/try"], capsys)
    assert code == 0, err
    assert "kept 2 file(s) of exports/try that memlm did not write: .git/HEAD, MODEL_CARD.md" in stdout
    assert (out / "MODEL_CARD.md").read_text() == "card\n"
    assert (out / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n"
    listed = json.loads((out / MANIFEST_NAME).read_text())["files"]
    assert "MODEL_CARD.md" not in listed and set(listed) == set(folder_manifest(out)) - {
        MANIFEST_NAME, "MODEL_CARD.md", ".git/HEAD"}
    from_pretrained(out)  # the user's files are never read nor checked
    assert sorted(p.name for p in out.parent.iterdir()) == ["try"]  # nothing left beside it
    # --overwrite replaces a whole export: refused while it holds the user's files.
    before = hashes(out)
    code, _, err = run_main("memlm.run.export", ["runs/try", "exports/try", "--overwrite"], capsys)
    refused(code, err, "exports/try holds files the export did not write (.git/HEAD, MODEL_CARD.md)")
    assert hashes(out) == before
    # A file of the export that the user changed is not the export's to replace without --overwrite.
    shutil.rmtree(out / ".git")
    (out / "MODEL_CARD.md").unlink()
    (out / "generation_config.json").write_text('{"do_sample": true}\n')
    before = hashes(out)
    code, _, err = run_main("memlm.run.export", ["runs/try", "exports/try"], capsys)
    refused(code, err, "were changed since it was written (generation_config.json)", "--overwrite")
    assert hashes(out) == before
    code, _, err = run_main("memlm.run.export", ["runs/try", "exports/try", "--overwrite"], capsys)
    assert code == 0, err
    assert json.loads((out / "generation_config.json").read_text())["do_sample"] is False


def test_export_refuses_a_folder_that_is_no_export(runs, capsys):
    mine = Path("mine")
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (Path("a_file")).write_text("mine")
    for argv, named in [(["runs/try", "mine"], "mine is not empty and is not a memlm export"),
                        (["runs/try", "mine", "--overwrite"], "mine is not empty and is not a memlm export"),
                        (["runs/try", "a_file", "--overwrite"], "a_file is a file")]:
        code, _, err = run_main("memlm.run.export", argv, capsys)
        refused(code, err, named)
    assert (mine / "notes.txt").read_text() == "mine" and Path("a_file").read_text() == "mine"
    # An export written before manifests: memlm cannot tell its files from the user's.
    old = export(runs / "try", Path("exports/old"))
    (old / MANIFEST_NAME).unlink()
    before = hashes(old)
    code, _, err = run_main("memlm.run.export", ["runs/try", "exports/old", "--overwrite"], capsys)
    refused(code, err, "memlm cannot tell its own files", MANIFEST_NAME)
    assert hashes(old) == before


# ---------------------------------------------------------------- item 8: modes and checksums
@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_every_file_of_an_export_follows_the_umask(runs, umask):
    previous = os.umask(umask)
    try:
        out = export(runs / "try", Path("exports/try"))
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert "model.safetensors" in modes and modes == dict.fromkeys(modes, 0o666 & ~umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask


def scramble(path: Path, n: int, seed: int = 0) -> None:
    """Flip every bit of `n` bytes at random places past the header: the file keeps its size."""
    data = bytearray(path.read_bytes())
    rng = random.Random(seed)
    for _ in range(n):
        data[rng.randrange(1024, len(data))] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damaged_export_bytes_are_named_by_every_read(runs, capsys):
    from memlm.config.run import compose
    from memlm.errors import ConfigError
    from memlm.train.preflight import check_init_from

    good = export(runs / "try", Path("exports/try"))
    (good / "MODEL_CARD.md").write_text("a file of the user's: never checked\n")
    from_pretrained(good)
    weights = good / "model.safetensors"
    original = weights.read_bytes()
    scramble(weights, 200_000)
    assert weights.stat().st_size == len(original)
    line = f"export file {weights} is corrupted (crc32 mismatch)"
    with pytest.raises(ExportError, match="corrupted") as err:
        from_pretrained(good)
    assert str(err.value).startswith(line)
    code, _, err = run_main("memlm.generate.cli", [good, "--prompt", "x", "--max-new-tokens", "2"], capsys)
    assert code == FAULT_EXIT and err.strip().splitlines()[-1].startswith(f"error: {line}"), err
    code, _, err = run_main("memlm.evals.cli", [f"checkpoint={good}", "tasks=[synthetic_qa]", "out=r.json",
                                                f"tokenizer={good / 'MODEL_CARD.md'}"], capsys)
    assert code == FAULT_EXIT and err.strip().splitlines()[-1].startswith(f"error: {line}"), err
    for init_from in (str(good), f"hf:{good}"):
        with pytest.raises(ConfigError, match="model.safetensors is corrupted"):
            check_init_from(compose([*RUN, f"init_from={init_from}"]))
    # An edited config that still parses, an edited or missing manifest: named alike.
    weights.write_bytes(original)
    from_pretrained(good)
    config = good / "memlm_config.json"
    config.write_text(config.read_text().replace('"step": 2', '"step": 3'))
    with pytest.raises(ExportError, match=f"export file {config} is corrupted"):
        from_pretrained(good)
    config.write_text(config.read_text().replace('"step": 3', '"step": 2'))
    manifest = good / MANIFEST_NAME
    manifest.write_text(manifest.read_text().replace('"size": ', '"size": 1', 1))
    with pytest.raises(ExportError, match=f"{manifest} is corrupted or was edited"):
        from_pretrained(good)
    manifest.unlink()
    with pytest.raises(ExportError, match=f"{manifest} is missing"):
        from_pretrained(good)


def test_an_export_checked_once_is_not_hashed_again_until_a_file_changes(runs, monkeypatch):
    import memlm.files

    out = export(runs / "try", Path("exports/try"))
    settled = os.stat(out).st_mtime - 60  # written a minute ago: the check is remembered
    for path in out.iterdir():
        os.utime(path, (settled, settled))
    hashed = []
    real = memlm.files.crc32_file
    monkeypatch.setattr(memlm.files, "crc32_file", lambda path: hashed.append(Path(path).name) or real(path))
    from_pretrained(out)
    from_pretrained(out)
    listed = json.loads((out / MANIFEST_NAME).read_text())["files"]
    assert sorted(hashed) == sorted(listed)  # one pass over every file the export wrote
    scramble(out / "model.safetensors", 10)  # a write after the check: its mtime is now
    with pytest.raises(ExportError, match="model.safetensors is corrupted"):
        from_pretrained(out)


# ---------------------------------------------------------------- every other command that writes
def test_evals_out_replaces_only_an_earlier_report(runs, capsys):
    notes = Path("notes.json")
    Path("notes.md").write_text("my notes\n")  # out=notes.json would also write notes.md
    base = ["checkpoint=runs/try", "tasks=[synthetic_qa]"]
    code, _, err = run_main("memlm.evals.cli", [*base, f"out={notes}"], capsys)
    refused(code, err, "notes.md exists and is not a report of memlm.evals")
    code, _, err = run_main("memlm.evals.cli", [*base, f"out={notes}", "replace=true"], capsys)
    refused(code, err, "notes.md exists and is not a report of memlm.evals")
    Path("data.json").write_text('{"mine": 1}\n')
    code, _, err = run_main("memlm.evals.cli", [*base, "out=data.json", "replace=true"], capsys)
    refused(code, err, "data.json exists and is not a report of memlm.evals")
    checkpoint = runs / "try" / "checkpoints" / "step_00000002"
    code, _, err = run_main("memlm.evals.cli", [*base, f"out={checkpoint / 'r.json'}"], capsys)
    refused(code, err, "lies inside the model it evaluates")
    assert Path("notes.md").read_text() == "my notes\n" and Path("data.json").read_text() == '{"mine": 1}\n'
    written = json.loads((checkpoint / "meta.json").read_text())["manifest"]
    assert sorted(p.name for p in checkpoint.iterdir()) == sorted([*written, "meta.json"])


def test_slot_usage_replaces_only_a_slot_usage_file(runs, capsys):
    Path("mine.safetensors").write_text("not safetensors")
    code, _, err = run_main("memlm.train.slot_usage", ["runs/try", "--batches", "1", "--out", "mine.safetensors"],
                            capsys)
    refused(code, err, "mine.safetensors exists and is not a slot-usage file")
    assert Path("mine.safetensors").read_text() == "not safetensors"
    code, _, err = run_main("memlm.train.slot_usage", ["runs/try", "--batches", "1", "--out", "bg.safetensors"],
                            capsys)
    assert code == 0, err
    written = Path("bg.safetensors").read_bytes()
    # another count over the same path: refused unless asked for (beside a checkpoint, the file may be the
    # background its training recorded, which nothing but that training writes again)
    code, _, err = run_main("memlm.train.slot_usage", ["runs/try", "--batches", "2", "--out", "bg.safetensors"],
                            capsys)
    refused(code, err, "bg.safetensors exists (a slot-usage file): add --overwrite to replace it")
    assert Path("bg.safetensors").read_bytes() == written
    code, _, err = run_main("memlm.train.slot_usage", ["runs/try", "--batches", "2", "--out", "bg.safetensors",
                                                       "--overwrite"], capsys)
    assert code == 0, err
    assert Path("bg.safetensors").read_bytes() != written  # 2 batches counted, not 1
    assert Path("bg.safetensors").stat().st_mode & 0o777 == 0o666 & ~_umask()  # not safetensors' 0600


def test_slot_usage_leaves_the_background_a_training_recorded_beside_its_checkpoint(tmp_path, capsys, monkeypatch):
    """A base's training writes its own background over its last steps (checkpoint.slot_usage_steps) where
    slot_usage writes by default: counting another corpus there must not replace it (#50: a 1M base's was,
    by a count of the paraphrase batches, and only training the base again brought it back)."""
    from memlm.train.cli import main as train

    monkeypatch.chdir(tmp_path)
    assert train([*RUN, "steps=2", "checkpoint.slot_usage_steps=1", "dump_dir=runs/base"]) == 0
    (checkpoint,) = Path("runs/base/checkpoints").glob("step_*")
    recorded = (checkpoint / "slot_usage.safetensors").read_bytes()
    code, _, err = run_main("memlm.train.slot_usage", [str(checkpoint), "--batches", "1"], capsys)
    refused(code, err, f"{checkpoint / 'slot_usage.safetensors'} exists (a slot-usage file): add --overwrite")
    assert (checkpoint / "slot_usage.safetensors").read_bytes() == recorded


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_the_tokenizer_and_prepare_write_over_nothing_of_the_users(runs, capsys, tmp_path):
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(3, 8))) for _ in range(300)]
    corpus = Path("corpus.txt")
    corpus.write_text("\n".join(" ".join(rng.choices(words, k=12)) for _ in range(400)) + "\n")
    before = corpus.read_bytes()
    train = ["train", "--input", "corpus.txt", "--format", "text", "--vocab-size", "300", "--threads", "1"]
    code, _, err = run_main("memlm.data.tokenizer", [*train, "--out", "corpus.txt", "--overwrite"], capsys)
    refused(code, err, "corpus.txt is one of its --input files")
    Path("notes.model").write_text("mine")
    code, _, err = run_main("memlm.data.tokenizer", [*train, "--out", "notes.model", "--overwrite"], capsys)
    refused(code, err, "notes.model exists and is not a sentencepiece model")
    assert corpus.read_bytes() == before and Path("notes.model").read_text() == "mine"
    code, _, err = run_main("memlm.data.tokenizer", [*train, "--out", "tok.model"], capsys)
    assert code == 0, err
    code, _, err = run_main("memlm.data.tokenizer", [*train, "--out", "tok.model"], capsys)
    refused(code, err, "tok.model exists (a sentencepiece model): add --overwrite")
    code, _, err = run_main("memlm.data.tokenizer", [*train, "--out", "tok.model", "--overwrite"], capsys)
    assert code == 0, err
    # prepare: never into a run folder; a manifest.json of the user's is never replaced.
    prepare = ["--source", "web=corpus.txt", "--format", "text", "--tokenizer", "tok.model", "--workers", "1"]
    code, _, err = run_main("memlm.data.prepare", [*prepare, "--out", "runs/try"], capsys)
    refused(code, err, "runs/try is a memlm run folder")
    Path("shards").mkdir()
    Path("shards/manifest.json").write_text('{"mine": true}\n')
    code, _, err = run_main("memlm.data.prepare", [*prepare, "--out", "shards"], capsys)
    refused(code, err, "manifest.json exists and is not a shard manifest of memlm.data.prepare")
    assert sorted(os.listdir("shards")) == ["manifest.json"]
    Path("shards/manifest.json").unlink()
    Path("shards/README").write_text("mine")
    for _ in range(2):  # a new shard set, then resumed: the user's file beside it untouched
        code, _, err = run_main("memlm.data.prepare", [*prepare, "--out", "shards"], capsys)
        assert code == 0, err
    assert Path("shards/README").read_text() == "mine"


def test_the_demo_replaces_only_what_it_wrote(tmp_path, capsys):
    from memlm.launch.demo import DemoFolderError, claim_folders, mark_finished

    dump, out = tmp_path / "runs" / "demo", tmp_path / "exports" / "demo"
    claim_folders(dump, out)  # a demo starts, and is killed before it ends
    (dump / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(DemoFolderError, match="did not finish"):
        claim_folders(dump, out)
    assert (dump / "metrics.jsonl").is_file()
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"demo weights")
    write_manifest(out)
    mark_finished(dump, out)  # a demo that ended
    (dump / "evals" / "cli").mkdir(parents=True)
    (dump / "evals" / "cli" / "2_later.json").write_text("{}")  # a later memlm.evals result
    (out / "MODEL_CARD.md").write_text("card")
    (dump / "metrics.jsonl").write_text("edited\n")
    with pytest.raises(DemoFolderError) as err:
        claim_folders(dump, out)
    for name in (dump / "evals/cli/2_later.json", dump / "metrics.jsonl", out / "MODEL_CARD.md"):
        assert str(name) in str(err.value)
    assert (out / "MODEL_CARD.md").read_text() == "card" and (dump / "metrics.jsonl").read_text() == "edited\n"
    shutil.rmtree(dump / "evals")
    (out / "MODEL_CARD.md").unlink()
    mark_finished(dump, out)
    claim_folders(dump, out)  # nothing but the demo's: replaced
    assert "replacing the previous demo run" in capsys.readouterr().out
    assert not out.exists() and sorted(p.name for p in dump.iterdir()) == [".memlm-demo"]
