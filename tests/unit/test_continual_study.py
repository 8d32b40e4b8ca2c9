"""The continual-learning study's driver (memlm.launch.continual_study), with training faked."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from memlm.launch import continual_runs
from memlm.launch import continual_study as study
from memlm.launch.continual_runs import (
    AGAIN,
    DATA,
    RECORDS,
    RUNS,
    Series,
    base_run,
    batch_background,
    ranks_by_batches,
    round_runs,
    sweep_run,
)
from memlm.studies import continual_plan


def _fake_train(calls, fail=(), evals=None, environment=None, preempt=()):
    """A subprocess.run stand-in: writes what a finished run leaves in its dump_dir (`evals`: a base's;
    `environment`: what its summary says it ran on; `preempt`: names whose runs stop early, as SIGTERM
    stops one: checkpointed, a summary saying so, exit 0)."""
    def run(cmd, **kw):
        if cmd[2] == "memlm.train.slot_usage":  # a batch background: [checkpoint, --batches, N, --out, file]
            calls.append({"slot_usage": cmd[3], "batches": cmd[5], "out": cmd[7]})
            Path(cmd[7]).write_text("")
            return subprocess.CompletedProcess(cmd, 0)
        overrides = dict(o.split("=", 1) for o in cmd[3:])
        calls.append(overrides)
        name = overrides["dump_dir"].rsplit("/", 1)[1]
        if name in fail:
            return subprocess.CompletedProcess(cmd, 1)
        dump = Path(overrides["dump_dir"])
        (dump / "evals").mkdir(parents=True, exist_ok=True)
        steps = int(overrides.get("steps", 300))
        if name in preempt:
            (dump / "summary.json").write_text(json.dumps({"steps": 21, "evals": {}, "preempted": True}))
            (dump / "checkpoints" / "step_00000021").mkdir(parents=True)
            return subprocess.CompletedProcess(cmd, 0)
        em = {"full": 0.99, "memory": 0.97, "sparse": 0.96, "lora": 0.5}.get(overrides.get("finetune"), 0.0)
        lr = float(overrides.get("memory.value_lr", overrides.get("optim.lr", 1.0)))
        scores = {"bits:facts_a": {"stored_bits": 1000.0 - lr}, "bits:facts_b": {"exact_match": em}}
        if evals is not None and "finetune" not in overrides:
            scores = evals
        (dump / "summary.json").write_text(json.dumps({"steps": steps, "evals": scores, "environment": environment}))
        (dump / "checkpoints" / f"step_{steps:08d}").mkdir(parents=True, exist_ok=True)
        for f in ("config.yaml", "metrics.jsonl"):
            (dump / f).write_text("")
        (dump / "evals" / f"{steps}.json").write_text("{}")
        return subprocess.CompletedProcess(cmd, 0)
    return run


def _study_folder(tmp_path, monkeypatch, rounds: int = 2) -> None:
    """Work in tmp_path, with a corpora manifest of `rounds` rounds (the driver writes none then)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / DATA).mkdir(parents=True)
    (tmp_path / DATA / "manifest.json").write_text(json.dumps({"rounds": rounds}))


def _round_modes(monkeypatch, *modes: str) -> None:
    """The plan with these round modes (the study's own plan names one, for #50's budget): the driver's rounds
    and --stage seeds for several modes at once."""
    patched = dataclasses.replace(continual_plan.plan(), round_modes=modes)
    for module in (study, continual_runs):
        monkeypatch.setattr(module, "plan", lambda: patched)


def _error_line(capsys, pattern: str) -> bool:
    """The command ended through the one error path: its last stderr line is `error: ...` matching `pattern`."""
    import re

    last = capsys.readouterr().err.strip().splitlines()[-1]
    return last.startswith("error: ") and re.search(pattern, last) is not None


def test_runs_chain_from_the_base_and_a_recorded_run_is_skipped(tmp_path, monkeypatch):
    _study_folder(tmp_path, monkeypatch)
    _round_modes(monkeypatch, "full", "memory", "sparse")
    calls = []
    monkeypatch.setattr(study.subprocess, "run", _fake_train(calls))
    assert study.main(["--stage", "base"]) == 0
    assert calls[0]["experiment"] == "continual_base" and (RECORDS / "base_s0" / "command.txt").exists()
    assert study.main(["--stage", "all", "--modes", "memory,sparse"]) == 0
    base_ckpt = str(RUNS / "base_s0" / "checkpoints" / "step_00000300")
    sweep = [c for c in calls[1:] if "data.sources.0.path" not in c]  # rounds train on a round's facts
    own = continual_plan.finetune_config().memory.n_keys  # the study's own size: the common sweep and its sweep_at
    planned = [mode for mode, _ in continual_plan.plan().sweep_of(own) if mode in ("memory", "sparse")]
    assert len(sweep) == len(planned) and all(c["init_from"] == base_ckpt for c in sweep)  # the base was not rerun
    rounds = [c for c in calls if c.get("steps") == str(continual_plan.plan().round_steps)]
    # each mode's best: the smallest value lr of those that learned (the fake loses lr bits of facts A)
    assert [(c["finetune"], c["finetune.optimizer"], c.get("memory.value_lr"), c["data.sources.0.path"].split("/")[-2])
            for c in rounds] == [
        ("memory", "sgd", "300", "facts_b1"), ("memory", "sgd", "300", "facts_b2"),
        ("sparse", "sgd", "1000", "facts_b1"), ("sparse", "sgd", "1000", "facts_b2")]
    assert rounds[0]["init_from"] == base_ckpt
    first = RUNS / "s0_rounds_memory_value_lr300_r1"
    assert rounds[1]["init_from"] == str(first / "checkpoints" / "step_00000060")
    # the base's background, for the mode that reads one (finetune=memory refuses a setting it ignores)
    assert [c.get("finetune.background") for c in rounds] == [None, None, *[f"{base_ckpt}/slot_usage.safetensors"] * 2]
    n = len(calls)
    assert study.main(["--stage", "all", "--modes", "memory,sparse"]) == 0 and len(calls) == n  # all recorded


def test_a_second_table_size_runs_under_its_own_names_with_its_size(tmp_path, monkeypatch, capsys):
    _study_folder(tmp_path, monkeypatch)
    _round_modes(monkeypatch, "sparse")
    calls = []
    monkeypatch.setattr(study.subprocess, "run", _fake_train(calls))
    assert study.main(["--stage", "all", "--modes", "sparse", "--n-keys", "256"]) == 0
    names = [c["dump_dir"].rsplit("/", 1)[1] for c in calls]
    assert names[0] == "k256_base_s0" and names[1] == "k256_s0_sparse_top_t8000_value_lr1000"
    assert names[-1] == "k256_s0_rounds_sparse_top_t8000_value_lr1000_r2"
    assert all(c["memory.n_keys"] == "256" for c in calls)
    base_ckpt = str(RUNS / "k256_base_s0" / "checkpoints" / "step_00000300")
    assert all(c["init_from"] == base_ckpt for c in calls[1:-1])  # the sweep and round 1 start from its base
    # the study's own size keeps its names: nothing above is reused for it, nor it for them
    assert study.main(["--stage", "base", "--n-keys", "128"]) == 0
    assert calls[-1]["dump_dir"].endswith("/base_s0") and "memory.n_keys" not in calls[-1]
    assert study.main(["--n-keys", "1"]) == 2
    assert "--n-keys=1: an integer >= 2 (memory.n_keys; the study's own is 128)" in capsys.readouterr().err


def test_a_recorded_base_without_its_checkpoint_is_trained_again_and_must_equal_its_record(tmp_path, monkeypatch,
                                                                                          capsys):
    """A fresh clone has the records, not the runs/ checkpoints the next fine-tunes start from."""
    _study_folder(tmp_path, monkeypatch)
    calls = []
    monkeypatch.setattr(study.subprocess, "run", _fake_train(calls, evals={"bits:facts_a": {"stored_bits": 7.0}}))
    assert study.main(["--stage", "base"]) == 0
    record = (RECORDS / "base_s0" / "summary.json").read_text()
    study.shutil.rmtree(RUNS / "base_s0")
    assert study.main(["--stage", "base"]) == 0 and len(calls) == 1  # nothing starts from it: not retrained
    assert study.main(["--stage", "sweep", "--modes", "full"]) == 0
    names = [c["dump_dir"].rsplit("/", 1)[1] for c in calls]
    assert names[1] == "base_s0" and names[2].startswith("s0_full_") and names.count("base_s0") == 2
    assert (RECORDS / "base_s0" / "summary.json").read_text() == record
    rerun = json.loads((RECORDS / "base_s0" / study.REPRODUCED).read_text())  # kept: the report lists it
    assert rerun["evals"] == {"bits:facts_a": {"stored_bits": 7.0}}
    # a base that comes out different would not continue its record: the study stops, naming both
    study.shutil.rmtree(RUNS / "base_s0")
    monkeypatch.setattr(study.subprocess, "run", _fake_train(calls, evals={"bits:facts_a": {"stored_bits": 8.0}}))
    capsys.readouterr()
    assert study.main(["--stage", "sweep", "--modes", "memory"]) == 1
    assert _error_line(capsys, r"base_s0 trained again does not reproduce its record .*8\.0.*7\.0")
    assert "8.0" in (RECORDS / "base_s0" / study.REPRODUCED).read_text()  # a failing rerun is kept too


HERE = {"commit": "a" * 40, "dirty": False, "torch": "2.13.0", "cpu": "AMD EPYC", "cpu_capability": "AVX2"}


@pytest.mark.parametrize("rerun_env, rerun_bits, message", [
    (HERE, 7.0, "the record's commit, torch, CPU and vector unit: equal evaluations asked"),  # all match
    ({**HERE, "cpu": "other"}, 7.1, "every figure within 2% asked"),  # elsewhere: 1.4% off passes
    ({**HERE, "cpu_capability": "AVX512"}, 7.1, "every figure within 2% asked"),  # one CPU name, other kernels
    ({**HERE, "commit": "b" * 40}, 7.1, "every figure within 2% asked"),
    ({**HERE, "dirty": True}, 7.1, "every figure within 2% asked"),  # a changed tree promises nothing
])
def test_a_retrained_run_is_checked_bitwise_only_where_commit_torch_cpu_and_vector_unit_match(
        tmp_path, monkeypatch, capsys, rerun_env, rerun_bits, message):
    _study_folder(tmp_path, monkeypatch)
    calls = []
    monkeypatch.setattr(study.subprocess, "run",
                        _fake_train(calls, evals={"bits:facts_a": {"stored_bits": 7.0}}, environment=HERE))
    assert study.main(["--stage", "base"]) == 0
    study.shutil.rmtree(RUNS / "base_s0")
    monkeypatch.setattr(study.subprocess, "run", _fake_train(
        calls, evals={"bits:facts_a": {"stored_bits": rerun_bits}}, environment=rerun_env))
    capsys.readouterr()
    assert study.main(["--stage", "sweep", "--modes", "full"]) == 0
    assert message in capsys.readouterr().out
    # the same rerun 3% off: refused in both cases, the check it made named
    study.shutil.rmtree(RUNS / "base_s0")
    monkeypatch.setattr(study.subprocess, "run", _fake_train(
        calls, evals={"bits:facts_a": {"stored_bits": 7.21}}, environment=rerun_env))
    assert study.main(["--stage", "sweep", "--modes", "memory"]) == 1
    assert _error_line(capsys, r"base_s0 trained again does not reproduce its record .*" + message.split(":")[0][:20])


def test_a_failed_run_stops_the_study_naming_its_log(tmp_path, monkeypatch, capsys):
    _study_folder(tmp_path, monkeypatch)
    monkeypatch.setattr(study.subprocess, "run", _fake_train([], fail=("base_s0",)))
    assert study.main(["--stage", "base"]) == 1
    assert _error_line(capsys, r"base_s0 failed \(exit 1\).*runs/continual/base_s0.log")
    assert not (RECORDS / "base_s0").exists()


def test_a_second_seed_repeats_seed_0s_best_settings_from_its_own_base(tmp_path, monkeypatch, capsys):
    _study_folder(tmp_path, monkeypatch)
    _round_modes(monkeypatch, "full", "memory", "sparse")
    calls = []
    monkeypatch.setattr(study.subprocess, "run", _fake_train(calls))
    assert study.main(["--stage", "seeds", "--seed", "0"]) == 2  # a usage mistake: exit 2, as from every command
    assert _error_line(capsys, r"--seed=0: an integer >= 1 with --stage seeds")
    assert study.main(["--stage", "seeds", "--seed", "1"]) == 1
    assert _error_line(capsys, "no seed 0 base model .*base_s0 is missing")
    assert study.main(["--stage", "base"]) == 0
    capsys.readouterr()
    assert study.main(["--stage", "seeds", "--seed", "1"]) == 1
    assert _error_line(capsys, "seed 0's sweep has no finished full run")
    assert study.main(["--stage", "sweep"]) == 0
    n = len(calls)
    assert study.main(["--stage", "seeds", "--seed", "1"]) == 0
    repeated = calls[n:]
    assert [c["dump_dir"].rsplit("/", 1)[1] for c in repeated] == [
        "s1_full_lr1e-5_value_lr1e-3", "s1_memory_value_lr300", "s1_sparse_top_t8000_value_lr1000"]
    ckpt = str(RUNS / "base_s1" / "checkpoints" / "step_00000300")
    assert all(c["seed"] == "1" and c["init_from"] == ckpt for c in repeated)
    assert repeated[2]["finetune.top_t"] == "8000" and repeated[2]["finetune.optimizer"] == "sgd"


def test_rounds_of_a_small_batch_setting_keep_its_batch_and_its_share_of_steps(tmp_path, monkeypatch):
    """A sweep entry at 8 rows x 1,200 steps goes on to rounds at 8 rows x 240 steps (1,200 x 60 / 300):
    each round sees its facts as often as the setting's sweep run saw all of them, per fact."""
    monkeypatch.chdir(tmp_path)
    series = Series(0, 512)
    base = base_run(series)
    base.record.mkdir(parents=True)
    (base.record / "summary.json").write_text(json.dumps({"steps": 3000}))
    setting = ("finetune.optimizer=sgd", "finetune.top_t=8000", "memory.value_lr=1000", "data.micro_batch=8",
               "steps=1200")
    best = sweep_run(series, base, "sparse", setting)
    rounds = round_runs(series, base, best, 2)
    first, second = (dict(o.split("=", 1) for o in r.overrides) for r in rounds)
    name = "k512_s0_rounds_sparse_top_t8000_value_lr1000_micro_batch8_r{}"
    assert [r.name for r in rounds] == [name.format(i) for i in (1, 2)]
    assert first["data.micro_batch"] == "8" and first["steps"] == "240" and first["memory.n_keys"] == "512"
    assert second["init_from"] == str(RUNS / rounds[0].name / "checkpoints" / "step_00000240")
    assert rounds[1].start is rounds[0] and rounds[0].start is base


def test_an_unfinished_attempt_continues_from_its_checkpoint_and_one_without_starts_over(tmp_path, monkeypatch):
    """A stopped base (SIGTERM saves a checkpoint) is continued with resume=auto, not trained again from
    scratch; an attempt that saved nothing is started over in a fresh folder."""
    monkeypatch.chdir(tmp_path)
    RUNS.mkdir(parents=True)
    calls = []
    run = base_run(Series(0, None))

    def finish(cmd, **kw):  # what a run that reaches its last step leaves: its summary
        calls.append(cmd[3:])
        run.dump.mkdir(parents=True, exist_ok=True)
        (run.dump / "summary.json").write_text('{"steps": 300}')
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(study.subprocess, "run", finish)
    (run.dump / "checkpoints" / "step_00000250").mkdir(parents=True)
    (run.dump / "metrics.jsonl").write_text('{"step": 250}\n')
    study.train(run)
    assert calls[-1][-1] == "resume=auto" and (run.dump / "metrics.jsonl").exists()
    (run.dump / "checkpoints" / "step_00000250").rmdir()
    study.train(run)
    assert "resume=auto" not in calls[-1] and not (run.dump / "metrics.jsonl").exists()


def test_a_tfidf_batches_setting_ranks_against_the_bases_model_over_the_plans_background_batches(tmp_path,
                                                                                                 monkeypatch):
    """Lin et al.'s document frequency over about 1,000 pretraining batches: written once from the base's
    final checkpoint, before the first run that reads it (retraining the base where it is missing), and
    named by every run of such a setting, its rounds included; the other sparse settings keep the base's own."""
    _study_folder(tmp_path, monkeypatch)
    calls = []
    monkeypatch.setattr(study.subprocess, "run", _fake_train(calls))
    series = Series(0, 1024)
    base = base_run(series)
    assert study.main(["--stage", "base", "--n-keys", "1024"]) == 0
    study.shutil.rmtree(base.dump)  # a fresh clone: the base's record, not its checkpoint
    assert study.main(["--stage", "sweep", "--modes", "sparse", "--n-keys", "1024"]) == 0
    ckpt = RUNS / "k1024_base_s0" / "checkpoints" / "step_00000300"
    file = ckpt / f"slot_usage_{continual_plan.plan().background_batches}_batches.safetensors"
    writes = [i for i, c in enumerate(calls) if "slot_usage" in c]
    assert len(writes) == 1 and calls[writes[0]] == {"slot_usage": str(ckpt), "batches": "1000", "out": str(file)}
    by_batches = [c for c in calls if c.get("finetune.ranking") == "tfidf_batches"]
    planned = [e for mode, e in continual_plan.plan().sweep_of(1024) if "finetune.ranking=tfidf_batches" in e]
    assert len(by_batches) == len(planned) >= 3 and all(c["finetune.background"] == str(file) for c in by_batches)
    assert calls[writes[0] + 1] is by_batches[0]
    others = [c for c in calls if c.get("finetune") == "sparse" and c.get("finetune.ranking") != "tfidf_batches"]
    assert others and all("finetune.background" not in c for c in others)  # the base's, in their init_from
    setting = next(s for _, s in continual_plan.plan().sweep_only_at[1024] if ranks_by_batches(s))
    best = sweep_run(series, base, "sparse", setting)
    rounds = round_runs(series, base, best, 2)
    assert [r.background_of for r in rounds] == [base, base]
    assert all(f"finetune.background={file}" in r.overrides for r in rounds)
    # a later round on a machine without the base: the base trained again, then its background written
    study.shutil.rmtree(base.dump)
    n = len(calls)
    study.ensure_background(rounds[1])
    assert calls[n]["dump_dir"].endswith("/k1024_base_s0") and calls[n + 1]["out"] == str(file) and len(calls) == n + 2


def test_reproduce_trains_the_base_and_each_modes_best_setting_again_beside_the_study_and_checks_them(
        tmp_path, monkeypatch, capsys):
    """--stage reproduce: from scratch in runs/continual_again (the study's own checkpoints untouched), the
    fine-tunes from the base trained again; each rerun's summary kept beside its record; a rerun done before
    is checked, not repeated; one that differs stops the study naming both figures."""
    _study_folder(tmp_path, monkeypatch)
    calls = []
    monkeypatch.setattr(study.subprocess, "run", _fake_train(calls, evals={"bits:facts_a": {"stored_bits": 7.0}},
                                                             environment=HERE))
    assert study.main(["--stage", "reproduce"]) == 1
    assert _error_line(capsys, r"--stage reproduce: no record of base_s0")
    assert study.main(["--stage", "sweep", "--modes", "memory,sparse"]) == 0
    n = len(calls)
    assert study.main(["--stage", "reproduce"]) == 0
    again = calls[n:]
    assert [c["dump_dir"] for c in again] == [
        str(AGAIN / "base_s0"), str(AGAIN / "s0_memory_value_lr300"),
        str(AGAIN / "s0_sparse_top_t8000_value_lr1000")]  # each mode's best; none of lora, full
    assert all(c["init_from"] == str(AGAIN / "base_s0" / "checkpoints" / "step_00000300") for c in again[1:])
    for run in ("base_s0", "s0_memory_value_lr300", "s0_sparse_top_t8000_value_lr1000"):
        kept = (RECORDS / run / study.REPRODUCED).read_text()
        assert kept == (AGAIN / run / "summary.json").read_text()
    assert "equal evaluations asked: its evaluations reproduce the record's" in capsys.readouterr().out
    assert study.main(["--stage", "reproduce"]) == 0 and len(calls) == n + 3  # done here before: checked only
    study.shutil.rmtree(AGAIN)
    monkeypatch.setattr(study.subprocess, "run", _fake_train(calls, evals={"bits:facts_a": {"stored_bits": 7.5}},
                                                             environment={**HERE, "commit": "b" * 40}))
    assert study.main(["--stage", "reproduce"]) == 1
    assert _error_line(capsys, r"base_s0 trained again does not reproduce its record .*within 2% asked\): "
                               r"bits:facts_a.stored_bits 7.5 against 7.0")
    # the failing rerun is kept too (the report lists it as not reproducing), and the study's own runs stay
    assert '"stored_bits": 7.5' in (RECORDS / "base_s0" / study.REPRODUCED).read_text()
    assert (RUNS / "base_s0" / "summary.json").exists() and '"stored_bits": 7.0' in (
        RUNS / "base_s0" / "summary.json").read_text()


def test_reproduce_takes_the_best_learner_of_a_mode_none_of_whose_runs_learned_the_share(
        tmp_path, monkeypatch, capsys):
    """One fine-tune per mode: where no run of a mode learned the plan's share of facts B (LoRA here), the
    run that learned most is trained again, and the driver says so; a mode with no run is named."""
    _study_folder(tmp_path, monkeypatch)
    calls = []
    monkeypatch.setattr(study.subprocess, "run", _fake_train(calls, environment=HERE))
    assert study.main(["--stage", "sweep", "--modes", "lora", "--n-keys", "1024"]) == 0  # LoRA runs at 1M only
    lora = [c["dump_dir"].rsplit("/", 1)[1] for c in calls if c.get("finetune") == "lora"]
    series = Series(0, 1024)
    best = continual_runs.best_setting(study.sweep_runs(series, base_run(series)), "lora").name
    n = len(calls)
    assert study.main(["--stage", "reproduce", "--modes", "lora,memory", "--n-keys", "1024"]) == 0
    out = capsys.readouterr().out
    assert f"no recorded lora run at this size learned 95% of facts B: its best learner is reproduced ({best})" in out
    assert "no recorded memory run at this size: none reproduced" in out
    assert [c["dump_dir"].rsplit("/", 1)[1] for c in calls[n:]] == ["k1024_base_s0", best] and best in lora


def test_a_run_stopped_before_its_last_step_is_not_recorded_and_continues_where_it_stopped(
        tmp_path, monkeypatch, capsys):
    """A run stopped by SIGTERM checkpoints, writes a summary saying it was preempted and exits 0: the study
    stops naming it and records nothing; run again, it continues from the checkpoint (resume=auto). In
    --stage reproduce too, where such a rerun was once checked against its record as if finished."""
    _study_folder(tmp_path, monkeypatch)
    calls = []
    monkeypatch.setattr(study.subprocess, "run", _fake_train(calls, preempt=("base_s0",), environment=HERE))
    assert study.main(["--stage", "base"]) == 1
    assert _error_line(capsys, r"base_s0 stopped before its last step \(preempted, its checkpoint in "
                               r"runs/continual/base_s0\): nothing recorded")
    assert not (RECORDS / "base_s0").exists()
    monkeypatch.setattr(study.subprocess, "run", _fake_train(calls, environment=HERE))
    assert study.main(["--stage", "base"]) == 0
    assert calls[-1]["resume"] == "auto" and (RECORDS / "base_s0" / "summary.json").exists()
    monkeypatch.setattr(study.subprocess, "run", _fake_train(calls, preempt=("base_s0",), environment=HERE))
    assert study.main(["--stage", "reproduce"]) == 1  # the rerun in runs/continual_again stops early
    assert _error_line(capsys, r"base_s0 stopped before its last step \(preempted, its checkpoint in "
                               r"runs/continual_again/base_s0\)")
    assert not (RECORDS / "base_s0" / study.REPRODUCED).exists()
    monkeypatch.setattr(study.subprocess, "run", _fake_train(calls, environment=HERE))
    assert study.main(["--stage", "reproduce"]) == 0
    assert calls[-1]["dump_dir"] == str(AGAIN / "base_s0") and calls[-1]["resume"] == "auto"
    assert "its evaluations reproduce the record's" in capsys.readouterr().out


def test_a_later_round_of_a_tfidf_batches_setting_on_a_fresh_machine_writes_the_background_before_round_1(
        tmp_path, monkeypatch):
    """Rounds 1 and 2 recorded, nothing under runs/: round 3 retrains round 1 (which ranks against the base's
    batch background, so it is written first, after the base) and round 2, then trains itself."""
    _study_folder(tmp_path, monkeypatch, rounds=3)
    calls = []
    monkeypatch.setattr(study.subprocess, "run", _fake_train(calls))
    series = Series(0, 1024)
    base = base_run(series)
    setting = next(s for _, s in continual_plan.plan().sweep_only_at[1024] if ranks_by_batches(s))
    study.execute(base)
    rounds = round_runs(series, base, sweep_run(series, base, "sparse", setting), 3)
    for run in rounds[:2]:
        study.execute(run)
    study.shutil.rmtree(RUNS)
    RUNS.mkdir()
    n = len(calls)
    study.execute(rounds[2])
    order = [c.get("out") or c["dump_dir"] for c in calls[n:]]
    assert order == [str(base.dump), str(batch_background(base)), str(rounds[0].dump), str(rounds[1].dump),
                     str(rounds[2].dump)]
