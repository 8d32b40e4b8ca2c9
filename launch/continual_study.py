"""The continual-learning study, run by run: base model, fine-tuning sweep, rounds.

    OMP_NUM_THREADS=1 python -m memlm.launch.continual_study [--stage base|sweep|rounds|seeds|reproduce|all] [--seed 0]
        [--n-keys 256]

Each run is a plain `python -m memlm.train experiment=continual_* ...`
(configs/experiment/continual_base.yaml, continual_finetune.yaml), one after
another on this machine. Its dump goes to `runs/continual/<name>`; when it
finishes, its record (config.yaml, metrics.jsonl, summary.json, evals/ and
the command) is copied to `docs/runs/continual/<name>`, and a run whose
record exists is skipped: a study stopped halfway keeps every finished run
and resumes where it stopped. A recorded run that a later one starts from,
but whose checkpoint this machine lacks (a fresh clone), is trained again and
checked against its record; that rerun's summary is kept beside the record
as reproduced_summary.json. `python -m memlm.studies.continual_report`
turns the records into the tables and plot of docs/results.md.

`--n-keys N` runs the same study at another table size (N**2 slots): every
run of it carries `memory.n_keys=N` and is named `kN_...`, beside the
study's own size (the experiment's 128: 16K slots), whose names have no prefix.

What runs is the plan in configs/studies/continual.yaml
(`memlm.studies.continual_plan.load_plan`, which the report reads too): the
sweep's settings, the modes that go on to the rounds, the learning threshold
and the report's goals.

Stages:
- `base`: the corpora (memlm.data.continual) and the base model, pretrained
  on biographies + facts A, with its background slot usage.
- `sweep`: facts B taught by every entry of the plan's sweep (and of its
  `sweep_at` for this --n-keys; or the size's own list, `sweep_only_at`; at
  a seed > 0, the size's `later_seeds_at` where the plan has one), from the
  base's final checkpoint.
- `rounds`: facts B in rounds (facts_b1 ... facts_b5), each round starting
  from the previous round's final weights, for the best setting of each of
  the plan's round modes in the sweep (the least facts-A loss among the runs
  that learned at least the plan's `learned` share of facts B). A setting
  with its own batch and steps keeps its batch, and its steps scale with
  the plan's `round_steps`.
- `seeds`: with `--seed S` (S > 0), a second base model and the best
  setting of each round mode found in seed 0's sweep, at seed S.
- `reproduce`: the base and each mode's best setting trained again from
  scratch in runs/continual_again (the study's own runs untouched) and
  checked against their records (`check_against_record`); each rerun's summary.json is
  kept beside its record as reproduced_summary.json, which the report lists.

A setting ranked by `finetune.ranking=tfidf_batches` (Lin et al.'s document
frequency) ranks against the base's final model over the plan's
`background_batches` batches of its pretraining data (they count about 1,000),
written once beside the base's final checkpoint by `python -m
memlm.train.slot_usage` (`batch_background`); the other sparse settings rank
against the background the base recorded over its last steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from memlm.errors import ConfigError, MemlmError, entry_point
from memlm.launch.continual_runs import (
    AGAIN,
    DATA,
    RUNS,
    Run,
    Series,
    base_run,
    batch_background,
    best_setting,
    facts_b_exact_match,
    final_checkpoint,
    round_runs,
    sweep_run,
    sweep_runs,
)
from memlm.studies.continual_plan import plan
from memlm.studies.reproduction import REPRODUCED, reproduction_problem


class StudyError(MemlmError):
    """A run of the study failed, did not reproduce its record, or a stage lacks the runs it builds on
    (exit 1, one `error:` line from the entry point, as from every command)."""


def add_paraphrases() -> None:
    """The paraphrases of facts B and of each round (memlm.data.continual) where the study's corpora were
    written before they existed: the other files stay as they are."""
    from memlm.data.continual import paraphrase_folder, write_paraphrases

    seed = json.loads((DATA / "manifest.json").read_text()).get("seed", 0)
    for part in sorted(p.parent.name for p in DATA.glob("facts_b*/facts.jsonl")):
        if not (DATA / paraphrase_folder(part) / "train.jsonl").exists():
            print(f"[study] writing {DATA / paraphrase_folder(part)}: {part}'s paraphrases", flush=True)
            write_paraphrases(str(DATA), seed, part)


def table_size(n_keys: int | None) -> int | None:
    """--n-keys as a Series holds it: None for the experiment's own size (the study's first names)."""
    if n_keys is None:
        return None
    from memlm.config.run import compose

    own = compose(["experiment=continual_base"]).memory.n_keys
    if n_keys < 2:
        raise ConfigError("--n-keys", n_keys, f"an integer >= 2 (memory.n_keys; the study's own is {own})")
    return None if n_keys == own else n_keys


def execute(run: Run) -> None:
    """Train `run` unless its record exists; then copy the record. The run it starts from is trained
    again first where this machine lacks its checkpoint (a fresh clone holds records, not checkpoints)."""
    if (run.record / "summary.json").exists():
        print(f"[study] {run.name}: recorded, skipped", flush=True)
        return
    prepare(run)
    train(run)
    run.record.mkdir(parents=True, exist_ok=True)
    for name in ("config.yaml", "metrics.jsonl", "summary.json"):
        shutil.copy2(run.dump / name, run.record / name)
    shutil.copytree(run.dump / "evals", run.record / "evals", dirs_exist_ok=True)
    (run.record / "command.txt").write_text(f"OMP_NUM_THREADS=1 {run.command()}\n")
    print(f"[study] {run.name}: done -> {run.record}", flush=True)


def prepare(run: Run) -> None:
    """What `run` reads before it trains, made where this machine lacks it: the checkpoint it starts from
    (trained again) and the batch background it ranks against (written)."""
    if run.start is not None and not final_checkpoint(run.start).exists():
        retrain(run.start)
    ensure_background(run)


def ensure_background(run: Run) -> None:
    """The batch background `run` ranks against (`batch_background`), written where this machine lacks it:
    deterministic from the base's final checkpoint, so a fresh clone writes the same file."""
    base = run.background_of
    if base is None or batch_background(base).exists():
        return
    if not final_checkpoint(base).exists():
        retrain(base)
    out = batch_background(base)
    print(f"[study] {base.name}: writing its background over {plan().background_batches:,} batches -> {out}",
          flush=True)
    _run_logged(["memlm.train.slot_usage", str(final_checkpoint(base)), "--batches",
                 str(plan().background_batches), "--out", str(out)],
                base.root / f"{base.name}.background.log", f"{base.name}'s background")


def retrain(run: Run) -> None:
    """Train a recorded run again for its checkpoint and check it against the record: equal evaluations
    where the record's commit, torch, CPU and vector unit are this run's (the runs are deterministic on CPU), else
    each figure within the plan's `reproduce_within`; it says which check it made. The rerun is a
    reproduction from this clone: its summary.json is kept beside the record (REPRODUCED), as
    `--stage reproduce` keeps its own, a failing one too."""
    prepare(run)
    print(f"[study] {run.name}: recorded, but its checkpoint {final_checkpoint(run)} is not on this machine: "
          "training it again", flush=True)
    train(run)
    keep_rerun(run)
    check_against_record(run)


def keep_rerun(run: Run) -> None:
    """The rerun's summary.json beside the record it is checked against (the report lists it)."""
    shutil.copy2(run.dump / "summary.json", run.record / REPRODUCED)


def check_against_record(run: Run) -> None:
    """Stop the study where the run's dump does not reproduce its record (`reproduction_problem`)."""
    recorded = json.loads((run.record / "summary.json").read_text())
    again = json.loads((run.dump / "summary.json").read_text())
    problem, check = reproduction_problem(recorded, again, plan().reproduce_within)
    if problem:
        raise StudyError(f"{run.name} trained again does not reproduce its record {run.record} ({check}): "
                         f"{problem}; its checkpoint is left in {run.dump}")
    print(f"[study] {run.name}: trained again, {check}: its evaluations reproduce the record's", flush=True)


def reproduce(series: Series, modes: set[str] | None = None) -> None:
    """Train the series' base and one fine-tune per mode again, in AGAIN, and check each against its record:
    the fine-tune is the mode's best setting in the plan's sweep at that size (`best_setting`: the least
    forgetting among the runs that learned the plan's share of facts B; where none did, named, the run
    that learned most; a mode with no run at that size is named and skipped), started from the base
    trained again here. Each rerun's summary.json is kept beside its record (REPRODUCED), a failing one too, which the
    report then lists as not reproducing; a run that does not reproduce stops the study, naming both
    figures. A rerun finished here before is checked, not repeated; one stopped before its last step
    continues from its checkpoint."""
    base = base_run(series, AGAIN)
    if not (base.record / "summary.json").exists():
        raise StudyError(f"--stage reproduce: no record of {base.name} ({base.record}) to reproduce")
    recorded_sweep = sweep_runs(series, base_run(series))
    runs = [base]
    for mode in plan().report_order:
        if modes is not None and mode not in modes:
            continue
        best = best_setting(recorded_sweep, mode)
        if best is None:
            print(f"[study] reproduce: no recorded {mode} run at this size: none reproduced", flush=True)
            continue
        if facts_b_exact_match(best)[0] < plan().learned:
            print(f"[study] reproduce: no recorded {mode} run at this size learned {plan().learned:.0%} of facts B: "
                  f"its best learner is reproduced ({best.name})", flush=True)
        runs.append(sweep_run(series, base, best.mode, best.setting))
    for run in runs:
        if not finished(run.dump):
            prepare(run)
            train(run)
        keep_rerun(run)
        check_against_record(run)


def train(run: Run) -> None:
    """`python -m memlm.train` with the run's overrides, its output in runs/continual/<name>.log. An
    unfinished attempt that left a checkpoint (a stopped or preempted run: SIGTERM saves one) continues
    from it, bit for bit (resume=auto); one that left none starts over in a fresh folder."""
    resume = []
    if run.dump.exists():
        if any((run.dump / "checkpoints").glob("step_*")):
            resume = ["resume=auto"]
            print(f"[study] {run.name}: continuing the unfinished attempt in {run.dump} from its last checkpoint",
                  flush=True)
        else:
            shutil.rmtree(run.dump)  # the study's own folder of an attempt that saved nothing
    print(f"[study] {run.name}: {run.command()}", flush=True)
    _run_logged(["memlm.train", *run.overrides, *resume], run.root / f"{run.name}.log", run.name,
                append=bool(resume))
    if not finished(run.dump):  # a run stopped by SIGTERM checkpoints, writes its summary and exits 0
        raise StudyError(f"{run.name} stopped before its last step (preempted, its checkpoint in {run.dump}): "
                         "nothing recorded; run the study again to continue it")


def finished(dump: Path) -> bool:
    """Whether `dump` holds a run that reached its last step: its summary.json does not say it was
    preempted (a stopped run writes one too, and continues from its checkpoint)."""
    summary = dump / "summary.json"
    return summary.exists() and not json.loads(summary.read_text()).get("preempted", False)


def _run_logged(module_args: list[str], log: Path, what: str, append: bool = False) -> None:
    """`python -m <module_args>` on this machine, its output in `log`; a failure stops the study naming it."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "WANDB_SILENT": "true"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a" if append else "w") as out:
        rc = subprocess.run([sys.executable, "-m", *module_args], stdout=out, stderr=subprocess.STDOUT,
                            env=env).returncode
    if rc != 0:
        raise StudyError(f"{what} failed (exit {rc}); its log: {log}")


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memlm.launch.continual_study", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=("base", "sweep", "rounds", "seeds", "reproduce", "all"), default="all")
    parser.add_argument("--seed", type=int, default=0, help="the base model's and the fine-tunes' seed")
    parser.add_argument("--modes", default="", help="comma-separated modes to run in the sweep, or to reproduce "
                                                    "(default: all)")
    parser.add_argument("--n-keys", type=int, default=None,
                        help="the table size: memory.n_keys (n_keys**2 slots; default: the experiment's, 128); "
                             "runs at another size are named k<n_keys>_...")
    args = parser.parse_args(argv)
    if args.stage == "seeds" and args.seed == 0:  # a usage mistake: refused before any run starts
        raise ConfigError("--seed", args.seed, "an integer >= 1 with --stage seeds (it repeats seed 0's best "
                                               "settings at another seed)")
    RUNS.mkdir(parents=True, exist_ok=True)
    if not (DATA / "manifest.json").exists():
        from memlm.data.continual import write_study

        write_study(str(DATA))
    add_paraphrases()
    series = Series(args.seed, table_size(args.n_keys))
    modes = set(args.modes.split(",")) if args.modes else None
    if args.stage == "reproduce":
        reproduce(series, modes)
        return 0
    base = base_run(series)
    execute(base)
    if args.stage == "seeds":
        first = series.at_seed(0)
        if not (base_run(first).record / "summary.json").exists():
            raise StudyError(f"--stage seeds: no seed 0 base model ({base_run(first).record} is missing): "
                             "run seed 0's sweep first")
        seed0 = sweep_runs(first, base_run(first))
        for mode in plan().round_modes:
            best = best_setting(seed0, mode)
            if best is None:
                raise StudyError(f"--stage seeds: seed 0's sweep has no finished {mode} run to repeat")
            execute(sweep_run(series, base, best.mode, best.setting))
        return 0
    sweep = sweep_runs(series, base)
    if args.stage in ("sweep", "all"):
        for run in sweep:
            if modes is None or run.mode in modes:
                execute(run)
    if args.stage in ("rounds", "all"):
        rounds = json.loads((DATA / "manifest.json").read_text())["rounds"]
        for mode in plan().round_modes:
            best = best_setting(sweep, mode)
            if best is None:
                print(f"[study] rounds of {mode}: no finished sweep run of that mode, skipped", flush=True)
                continue
            for run in round_runs(series, base, best, rounds):
                execute(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
