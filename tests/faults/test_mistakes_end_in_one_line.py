"""A user's mistakes that printed a traceback, or ended with another exit code than the same
mistake elsewhere, end in one `error:` line and the kind's code (docs/errors.md; issue 54):

- slot_usage on a checkpoint with a mistyped key, a value of the wrong type, a preset, or a
  model/memory override it would ignore (before: a 72-line OmegaConf traceback, or silence);
- the tokenizer on whitespace-only input, and at a vocabulary sentencepiece refuses (300);
- logging.wandb.mode=online without W&B credentials, before the run folder exists;
- a checkpoint that does not exist: exit 1 from evals, generate, export and slot_usage alike
  (before: 2 from evals and generate);
- init_from=<checkpoint> with another architecture: the overrides that take the checkpoint's;
- a fine-tune that goes non-finite names the learning rate its mode trains (memory.value_lr).

A `checkpoints/latest` naming no checkpoint is warned about, naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli import run_main as run_command

FAULT_EXIT, USAGE_EXIT = 1, 2  # docs/errors.md

ARCH = ["memory=memplus", "memory.layers=[1]", "memory.n_keys=16", "memory.knn=4", "memory.eval_knn=4",
        "memory.k_dim=16", "memory.heads=2"]
TINY = ["model.vocab_size=128", "data.seq_len=16", "data.micro_batch=2", "data.kind=random", "val_batches=0",
        "logging.wandb.mode=disabled", "logging.every=1000"]


def run_main(module: str, argv: list[str], capsys) -> tuple[int, str]:
    result = run_command(module, *argv, capsys=capsys)
    return result.returncode, result.stderr


def one_error_line(err: str) -> str:
    """The one `error:` line, last on stderr (a progress bar may come before it), and no traceback."""
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in err, err
    return errors[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 2-step Memory+ run on random tokens: a real checkpoint with memory layers."""
    from memlm.config.run import compose
    from memlm.train.trainer import Trainer

    dump_dir = tmp_path_factory.mktemp("faults54") / "run"
    Trainer(compose([*TINY, *ARCH, "steps=2", f"dump_dir={dump_dir}"])).fit()
    return dump_dir


# ------------------------------------------------------------------ slot_usage's overrides
@pytest.mark.parametrize("override, piece", [
    ("data.micro_bacth=2", "unknown key data.micro_bacth; did you mean data.micro_batch?"),
    ("data.micro_batch=abc", "data.micro_batch='abc': a value of the key's type"),
    ("memory.n_keys=32", "memory.n_keys='32': data.* or seed"),
    ("model.dim=128", "model.dim='128': data.* or seed"),
    ("data=synthetic", "data='synthetic': data.* keys"),
    ("data.micro_batch=0", "data.micro_batch=0"),
])
def test_slot_usage_on_a_checkpoint_refuses_a_bad_override_in_one_line(run, override, piece, capsys):
    code, err = run_main("memlm.train.slot_usage", [str(run), "--batches", "1", override], capsys)
    assert code == USAGE_EXIT and piece in one_error_line(err), (code, err)
    assert not list(run.glob("checkpoints/*/slot_usage.safetensors"))  # nothing written


def test_slot_usage_on_a_checkpoint_takes_a_data_override(run, capsys):
    code, err = run_main("memlm.train.slot_usage", [str(run), "--batches", "1", "data.micro_batch=1"], capsys)
    assert code == 0, err
    written = list(run.glob("checkpoints/*/slot_usage.safetensors"))
    assert len(written) == 1
    written[0].unlink()  # this test's file: the refusals above write none


# ------------------------------------------------------------------ the tokenizer
def test_tokenizer_on_whitespace_only_input_names_it(tmp_path, capsys):
    corpus = tmp_path / "blank.jsonl"
    corpus.write_text('{"text": "   "}\n{"text": "\\n\\t\\n"}\n')
    code, err = run_main("memlm.data.tokenizer", ["train", "--input", str(corpus), "--out",
                                                  str(tmp_path / "t.model"), "--vocab-size", "300"], capsys)
    line = one_error_line(err)
    assert code == USAGE_EXIT and f"--input='{corpus}'" in line and "whitespace only" in line, line
    assert not (tmp_path / "t.model").exists()


def test_tokenizer_at_a_vocabulary_sentencepiece_refuses_names_the_size_needed(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    text = "".join(chr(c) for c in range(0x3b1, 0x3c9)) + " abcdefghijklmnopqrstuvwxyz 0123456789"  # 24 + 37 chars
    corpus.write_text("".join(json.dumps({"text": f"{text} {i}"}) + "\n" for i in range(50)))
    code, err = run_main("memlm.data.tokenizer", ["train", "--input", str(corpus), "--out",
                                                  str(tmp_path / "t.model"), "--vocab-size", "300",
                                                  "--character-coverage", "1.0"], capsys)
    line = one_error_line(err)
    assert code == USAGE_EXIT and "--vocab-size=300: at least 3" in line and "--character-coverage=1" in line, line
    needed = int(line.split("at least ")[1].split()[0])
    code, err = run_main("memlm.data.tokenizer", ["train", "--input", str(corpus), "--out",
                                                  str(tmp_path / "t.model"), "--vocab-size", str(needed),
                                                  "--character-coverage", "1.0"], capsys)
    assert code == 0, err  # the size the line names is enough


def test_a_run_whose_corpus_needs_a_larger_vocabulary_names_data_vocab_size(tmp_path, capsys):
    code, err = run_main("memlm.train.cli", ["data=synthetic", "data.vocab_size=300", "model.vocab_size=300",
                                             f"data.cache_dir={tmp_path / 'cache'}", "data.synthetic.people=40",
                                             "steps=1", "logging.wandb.mode=disabled",
                                             f"dump_dir={tmp_path / 'run'}"], capsys)
    line = one_error_line(err)
    assert code == USAGE_EXIT and "data.vocab_size=300: at least" in line and "coverage" not in line, line
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ wandb online without a key
def test_wandb_online_without_credentials_is_refused_before_the_run_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "no.netrc"))
    code, err = run_main("memlm.train.cli", [*TINY, "steps=1", "logging.wandb.mode=online",
                                             f"dump_dir={tmp_path / 'run'}"], capsys)
    line = one_error_line(err)
    assert code == USAGE_EXIT and "logging.wandb.mode='online'" in line and "wandb login" in line, line
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ a checkpoint that is not there
def test_a_missing_checkpoint_is_one_line_and_exit_1_from_every_command(tmp_path, capsys):
    missing = tmp_path / "runs" / "nope"
    commands = {
        "memlm.evals.cli": [f"checkpoint={missing}", "tasks=[synthetic_qa]"],
        "memlm.generate.cli": [str(missing), "--prompt", "x"],
        "memlm.run.export": [str(missing), str(tmp_path / "export")],
        "memlm.train.slot_usage": [str(missing), "--batches", "1"],
    }
    for module, argv in commands.items():
        code, err = run_main(module, argv, capsys)
        line = one_error_line(err)
        assert code == FAULT_EXIT and f"no checkpoint at {missing}" in line, (module, code, line)


def test_a_garbage_latest_is_named_in_a_warning(run, tmp_path, capsys):
    import shutil

    from memlm.run.source import model_source

    copy = Path(shutil.copytree(run, tmp_path / "run"))
    (copy / "checkpoints" / "latest").write_text("garbage\n")
    capsys.readouterr()
    source = model_source(copy)
    assert source.directory.name == "step_00000002"  # the newest complete checkpoint, as before
    err = capsys.readouterr().err
    assert f"{copy / 'checkpoints' / 'latest'} names no complete checkpoint ('garbage')" in err, err
    (copy / "checkpoints" / "latest").write_text("step_00000002\n")
    model_source(copy)
    assert "warning" not in capsys.readouterr().err


# ------------------------------------------------------------------ fine-tuning
def test_init_from_a_checkpoint_of_another_architecture_names_the_overrides(run, tmp_path, capsys):
    argv = [*TINY, "memory=memplus", "memory.layers=[1]", "finetune=memory", f"init_from={run}", "steps=1",
            f"dump_dir={tmp_path / 'ft'}"]
    code, err = run_main("memlm.train.cli", argv, capsys)
    line = one_error_line(err)
    assert code == USAGE_EXIT and "Run with the checkpoint's values: " in line, line
    fix = line.split("Run with the checkpoint's values: ")[1].split()
    assert {"memory.n_keys=16", "memory.k_dim=16", "memory.heads=2"} <= set(fix), fix
    assert not (tmp_path / "ft").exists()
    # Those overrides are enough (knn may differ: no tensors).
    code, err = run_main("memlm.train.cli", [*argv, *fix], capsys)
    assert code == 0, err


def test_a_memory_fine_tune_that_goes_non_finite_names_memory_value_lr(run, tmp_path, capsys):
    code, err = run_main("memlm.train.cli", [
        *TINY, *ARCH, "finetune=memory", "finetune.optimizer=sgd", "memory.value_lr=1e30", f"init_from={run}",
        "max_nonfinite_steps=2", "steps=10", f"dump_dir={tmp_path / 'ft'}"], capsys)
    line = one_error_line(err)
    assert code == FAULT_EXIT and "Lower memory.value_lr (now 1e+30: what finetune=memory trains with)" in line, line
    assert "optim.lr" not in line


# ------------------------------------------------------------------ usage mistakes argparse does not see
def test_usage_mistakes_past_argparse_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """A command named without its subcommand, and an option that contradicts another, end through the
    error path too, before any work starts (the study would otherwise train a base model first)."""
    monkeypatch.chdir(tmp_path)
    commands = {
        "memlm.launch.cli": ([], "python -m memlm.launch needs a command: local, slurm or sweep"),
        "memlm.launch.continual_study": (["--stage", "seeds", "--seed", "0"], "--seed=0: an integer >= 1"),
    }
    for module, (argv, piece) in commands.items():
        code, err = run_main(module, argv, capsys)
        line = one_error_line(err)
        assert code == USAGE_EXIT and piece in line, (module, code, line)
    assert list(tmp_path.iterdir()) == []  # nothing trained, nothing written
