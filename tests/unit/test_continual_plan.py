"""configs/studies/continual.yaml as the continual study's driver reads it (memlm.studies.continual_plan):
its entries by table size and seed, the run names they give, and the errors of a bad plan."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from memlm.errors import ConfigError
from memlm.launch.continual_runs import RECORDS, Series, base_run, sweep_run, sweep_runs
from memlm.studies import continual_plan


def test_the_plan_names_the_recorded_runs_so_they_are_reused():
    """Each 1M sweep record's command is the one the driver builds for its setting today: an entry the plan
    keeps finds its record by name and is not run again. Every 1M seed-0 entry of the plan is recorded."""
    series = Series(0, 1024)
    base = base_run(series)
    records = [p for p in (Path(__file__).resolve().parents[2] / RECORDS).glob("k1024_s0_*")
               if "_rounds_" not in p.name]
    for record in records:
        ran = (record / "command.txt").read_text()
        args = shlex.split(ran)
        mode = next(a.split("=", 1)[1] for a in args if a.startswith("finetune="))
        setting = tuple(args[args.index(f"finetune={mode}") + 1:args.index("seed=0")])
        run = sweep_run(series, base, mode, setting)
        assert (run.name, f"OMP_NUM_THREADS=1 {run.command()}\n") == (record.name, ran)
    assert {r.name for r in sweep_runs(series, base)} <= {r.name for r in records}


@pytest.mark.parametrize("entry,message", [
    ("[finetune=partial, optim.lr=1e-3]", r"sweep\[0\]='partial': not a fine-tune mode; valid: full, memory"),
    ("[optim.lr=1e-3]", r"sweep\[0\]=\['optim.lr=1e-3'\]: names 0 modes; each entry needs one finetune=<mode>"),
])
def test_a_bad_plan_entry_names_itself_and_what_is_valid(tmp_path, entry, message):
    text = continual_plan.PLAN_FILE.read_text()
    plan = tmp_path / "plan.yaml"
    plan.write_text(text[:text.index("sweep:")] + f"sweep:\n  - {entry}\n")
    with pytest.raises(ConfigError, match=message):
        continual_plan.load_plan(plan)


def test_every_plan_entry_composes():
    """A sweep entry the config refuses would stop the study halfway: each composes as its run is launched,
    at the study's smallest table (what depends on the size, a top_t above the slots, is refused there first)."""
    from memlm.config.run import compose

    for mode, setting in continual_plan.plan().sweep:
        compose(["experiment=continual_finetune", f"finetune={mode}", *setting])
    plan = continual_plan.plan()
    for n_keys in {*plan.sweep_at, *plan.sweep_only_at}:  # a size's own entries, at that size
        for mode, setting in plan.sweep_of(n_keys):
            compose(["experiment=continual_finetune", f"memory.n_keys={n_keys}", f"finetune={mode}", *setting])


def test_a_table_sizes_own_entries_run_at_that_size_only(tmp_path):
    """sweep_at.512 holds top_t values above the 16K table's slots: 256K runs them, the other sizes do not; the
    experiment's own size (a series with no n_keys) runs its sweep_at entry, 128."""
    at = {n: {r.name for r in sweep_runs(Series(0, n), base_run(Series(0, n)))}
          for n in (None, 256, 512)}
    assert "k512_s0_sparse_top_t32000_value_lr1000" in at[512]
    assert not any("top_t32000" in name for name in at[256] | at[None])
    common, added = continual_plan.plan().sweep, continual_plan.plan().sweep_at
    assert [len(at[n]) for n in (None, 256, 512)] == [len(common) + len(added[n]) for n in (128, 256, 512)]
    assert "s0_sparse_top_t8000_value_lr1000" in at[None]
    at_1m = [r.name for r in sweep_runs(Series(0, 1024), base_run(Series(0, 1024)))]
    assert len(at_1m) == len(continual_plan.plan().sweep_only_at[1024]) == len(set(at_1m))  # its own list only
    assert "k1024_s0_full_lr1e-5" in at_1m and "k1024_s0_lora_lr1e-3" not in at_1m
    text = continual_plan.PLAN_FILE.read_text()
    plan = tmp_path / "plan.yaml"
    plan.write_text(text.replace("sweep_only_at:\n", "sweep_only_at:\n  2048:\n    - [memory.value_lr=1]\n"))
    with pytest.raises(ConfigError, match=r"sweep_only_at.2048\[0\]=\['memory.value_lr=1'\]: names 0 modes"):
        continual_plan.load_plan(plan)
    plan.write_text(text.replace("sweep_only_at:\n", "sweep_only_at:\n  512:\n    - [finetune=full, optim.lr=1e-5]\n"))
    with pytest.raises(ConfigError, match=r"sweep_only_at=\[512\]: sizes not also under sweep_at"):
        continual_plan.load_plan(plan)


def test_a_later_seed_runs_the_plans_entries_for_it_which_must_be_seed_0s(tmp_path):
    """later_seeds_at.1024: seed 1 at 1M runs those of seed 0's entries only; a size it does not name runs its
    whole sweep at every seed; an entry seed 0 did not run is refused, naming it."""
    plan = continual_plan.plan()
    at_1m = [r.name for r in sweep_runs(Series(1, 1024), base_run(Series(1, 1024)))]
    assert len(at_1m) == len(plan.later_seeds_at[1024]) < len(plan.sweep_of(1024))
    assert set(plan.later_seeds_at[1024]) <= set(plan.sweep_of(1024))
    assert "k1024_s1_full_lr1e-5_value_lr1e-3" in at_1m
    assert len(sweep_runs(Series(1, 256), base_run(Series(1, 256)))) == len(plan.sweep_of(256))
    path = tmp_path / "plan.yaml"
    path.write_text(continual_plan.PLAN_FILE.read_text().replace(
        "later_seeds_at:\n  1024:\n", "later_seeds_at:\n  1024:\n    - [finetune=memory, memory.value_lr=7]\n"))
    with pytest.raises(ConfigError, match=r"later_seeds_at.1024\[0\]=\['memory.value_lr=7'\]: not an entry of this "
                                          r"size's seed-0 sweep \(finetune=memory\)"):
        continual_plan.load_plan(path)
