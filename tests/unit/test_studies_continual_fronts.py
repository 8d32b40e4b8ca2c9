"""Equal learning read off each mode's front (memlm.studies.continual_fronts), on hand-made points
and on small fabricated run records. The shares are dyadic where the claim is an exact value."""

from __future__ import annotations

import shutil

from continual_records import MEMORY, record

from memlm.studies import continual_report as report
from memlm.studies.continual_fronts import Point, Reading, at_level, front, level_lines

STUDY = (32, 300, "packed", "facts_b")  # the study's batch shape (continual_plan.batch_shape)


def _p(learned, lost, name="x"):
    return Point(name, learned, lost, learned, 0.0, STUDY)


def test_the_front_keeps_the_runs_nothing_beats_on_both_by_learning():
    a, b, c = _p(0.5, 100.0, "a"), _p(0.75, 300.0, "b"), _p(1.0, 700.0, "c")
    beaten = _p(0.5, 200.0, "beaten")  # learns as much as a and loses more
    assert front([c, beaten, a, b, _p(0.5, 100.0, "a again")]) == [a, b, c]


def test_a_level_is_interpolated_between_the_runs_that_bracket_it_and_never_beyond():
    points = front([_p(0.5, 100.0), _p(0.75, 300.0), _p(1.0, 700.0)])
    assert at_level(points, 0.625) == Reading(200.0, 0.625, "", (STUDY,))  # halfway from 0.5 to 0.75
    assert at_level(points, 0.875) == Reading(500.0, 0.875, "", (STUDY,))
    assert at_level(points, 0.75) == Reading(300.0, 0.75, "", (STUDY,))  # a run exactly at the level: its own loss
    assert at_level(points, 1.0) == Reading(700.0, 1.0, "", (STUDY,))
    assert at_level(points, 0.25) == Reading(None, None, "not bracketed (its least-learning run learns 50.0%)")
    short = front([_p(0.5, 100.0), _p(0.75, 300.0)])
    assert at_level(short, 0.875) == Reading(None, None, "does not reach it (at most 75.0%)")
    assert at_level([], 0.5) == Reading(None, None, "no runs")


def test_the_report_reads_every_mode_per_seed_and_sets_the_reference_against_the_best_of_the_rest(tmp_path):
    record(tmp_path, "base_s0", [], 800.0)
    record(tmp_path, "base_s1", [], 800.0, seed=1)
    record(tmp_path, "s0_full_lr1e-4", ["finetune=full", "optim.lr=1e-4"], 700.0, b=(0.9,))  # lost 100
    record(tmp_path, "s0_full_lr1e-3", ["finetune=full", "optim.lr=1e-3"], 100.0, b=(1.0,))  # lost 700
    record(tmp_path, "s1_full_lr1e-3", ["finetune=full", "optim.lr=1e-3"], 600.0, b=(0.93,), seed=1)
    record(tmp_path, "s0_memory_lr10", [*MEMORY, "memory.value_lr=10"], 792.0, b=(0.96,))  # lost 8
    record(tmp_path, "s0_memory_lr100", [*MEMORY, "memory.value_lr=100"], 760.0, b=(1.0,))  # lost 40
    record(tmp_path, "s1_memory_lr10", [*MEMORY, "memory.value_lr=10"], 792.0, b=(0.96,), seed=1)  # lost 8
    record(tmp_path, "s1_memory_lr100", [*MEMORY, "memory.value_lr=100"], 680.0, b=(1.0,), seed=1)  # lost 120
    bases, sweep, _ = report.load_study(tmp_path)
    lines = level_lines(bases, sweep)
    assert lines[:5] == [
        "- At 95% of facts B's bits learned (16,384 slots), facts-A bits lost (interpolated on each mode's "
        "front; facts-B EM there in brackets):",
        "  - `full`: mean 400 over 1 seed(s) (seed 0: 400 (EM 95.0%); seed 1: does not reach it (at most 93.0%))",
        "  - `memory`: no seed reaches it (seed 0: not bracketed (its least-learning run learns 96.0%); "
        "seed 1: not bracketed (its least-learning run learns 96.0%))",
        "  - `full` / the best of the rest: not measured, no other mode's front is read at this level (goal (a) at "
        "equal learning, at least 20x: open).",
        "- At 99% of facts B's bits learned (16,384 slots), facts-A bits lost (interpolated on each mode's "
        "front; facts-B EM there in brackets):"]
    assert lines[5:] == [
        "  - `full`: mean 640 over 1 seed(s) (seed 0: 640 (EM 99.0%); seed 1: does not reach it (at most 93.0%))",
        "  - `memory`: mean 62 over 2 seed(s) (seed 0: 32 (EM 99.0%); seed 1: 92 (EM 99.0%))",
        # full reaches 99% at seed 0 only: the ratio is taken there, not against memory's two-seed mean
        "  - `full` / `memory` (the best of the rest) over seed(s) 0: 20.0x (goal (a): at least 20x: met)."]
    assert "\n".join(lines) in report.render(bases, sweep, [])


def test_a_level_the_reference_mode_never_reaches_says_the_ratio_is_not_measured(tmp_path):
    """#50: full fine-tuning's gentlest runs learn 99%+ at 16K-256K, so at 95% it has no point: the goal
    line says the ratio is open instead of leaving it out."""
    record(tmp_path, "base_s0", [], 800.0)
    record(tmp_path, "s0_full_lr1e-4", ["finetune=full", "optim.lr=1e-4"], 400.0, b=(1.0,))
    record(tmp_path, "s0_memory_lr10", [*MEMORY, "memory.value_lr=10"], 792.0, b=(0.9,))
    record(tmp_path, "s0_memory_lr100", [*MEMORY, "memory.value_lr=100"], 760.0, b=(1.0,))
    bases, sweep, _ = report.load_study(tmp_path)
    lines = level_lines(bases, sweep)
    assert lines[3] == ("  - `full` / the best of the rest: not measured, no seed of `full` reaches this level "
                        "(goal (a) at equal learning, at least 20x: open).")
    # at 100% (the plan's levels stop at 99%): full reaches it, values-only's front does not
    record(tmp_path, "s0_full_lr3e-5", ["finetune=full", "optim.lr=3e-5"], 600.0, b=(0.9,))
    record(tmp_path, "s0_memory_lr1000", [*MEMORY, "memory.value_lr=1000"], 700.0, b=(0.96,))
    shutil.rmtree(tmp_path / "s0_memory_lr100")  # values-only now learns at most 96%
    bases, sweep, _ = report.load_study(tmp_path)
    assert level_lines(bases, sweep)[-1] == (
        "  - `full` / the best of the rest: not measured, no other mode's front is read at this level (goal (a) at "
        "equal learning, at least 20x: open).")


PARA = ["data.sources.0.path=data_cache/continual/facts_b_para/train.jsonl", "data.rows=documents",
        "data.shuffle=false", "data.micro_batch=8", "data.seq_len=32", "steps=2400"]


def test_goal_b_at_the_paper_batch_reads_each_mode_on_its_runs_at_that_batch_only(tmp_path):
    """#50: sparse against values-only at Lin et al.'s batch shape, both tuned: the fronts there, not the
    study batch's (where values-only learns with less forgetting here)."""
    from memlm.studies.continual_fronts import batch_lines, front_table

    record(tmp_path, "base_s0", [], 800.0, ppl=8.0)
    record(tmp_path, "s0_memory_lr100", [*MEMORY, "memory.value_lr=100"], 799.0, b=(1.0,))  # study batch: lost 1
    record(tmp_path, "s0_memory_para_lr100", [*MEMORY, "memory.value_lr=100", *PARA], 792.0, b=(0.5,))  # lost 8
    record(tmp_path, "s0_memory_para_lr300", [*MEMORY, "memory.value_lr=300", *PARA], 776.0, b=(1.0,))  # lost 24
    sparse = ["finetune=sparse", "finetune.optimizer=sgd", "finetune.top_t=500", *PARA]
    record(tmp_path, "s0_sparse_para_lr300", [*sparse, "memory.value_lr=300"], 800.0, b=(0.25,))  # lost 0
    record(tmp_path, "s0_sparse_para_lr1000", [*sparse, "memory.value_lr=1000"], 792.0, b=(0.5,), ppl=10.0)
    record(tmp_path, "s0_sparse_para_lr3000", [*sparse, "memory.value_lr=3000"], 784.0, b=(0.75,))  # lost 16
    bases, sweep, _ = report.load_study(tmp_path)
    batch = ", batches of 8 paraphrase rows (facts_b_para) x 2,400 steps"
    assert batch_lines(bases, sweep) == [
        "- Goal (b) at 16,384 slots, Lin et al.'s batch shape (8 paraphrase rows (facts_b_para) x 2,400 steps: one "
        "fact's paraphrases a batch): `sparse` tuned over 3 setting(s); `memory` tuned over 2 setting(s).",
        "  - at 95% of facts B's bits learned: `sparse` seed 0: does not reach it (at most 75.0%); `memory` seed 0: "
        "22 bits lost (EM 95.0%); not met: `sparse`'s front at this batch does not reach the level where "
        "`memory`'s does.",  # 8 + (0.95 - 0.5) / 0.5 * 16 = 22.4; at 99%: 23.7
        "  - at 99% of facts B's bits learned: `sparse` seed 0: does not reach it (at most 75.0%); `memory` seed 0: "
        "24 bits lost (EM 99.0%); not met: `sparse`'s front at this batch does not reach the level where "
        "`memory`'s does."]
    table = front_table(bases, sweep)
    assert f"| 16,384 | 0 | sparse | top_t 500, sgd lr 1000{batch} | 50.0% | 50.0% | 8 | +25.0% |" in table
    assert "| 16,384 | 0 | memory | sgd lr 100 | 100.0% | 100.0% | 1 | +12.5% |" in table  # 9.0 against 8.0
    assert not any(f"sgd lr 300{batch}" in row and "memory" in row for row in table)  # beaten by the study batch's


def test_goal_b_at_the_paper_batch_is_met_where_sparse_loses_no_more_at_the_level(tmp_path):
    record(tmp_path, "base_s0", [], 800.0)
    sparse = ["finetune=sparse", "finetune.optimizer=sgd", "finetune.top_t=500", *PARA]
    for name, overrides, a_bits, b in (("memory_a", [*MEMORY, "memory.value_lr=100"], 792.0, 0.5),
                                       ("memory_b", [*MEMORY, "memory.value_lr=300"], 768.0, 1.0),
                                       ("sparse_a", [*sparse, "memory.value_lr=300"], 796.0, 0.5),
                                       ("sparse_b", [*sparse, "memory.value_lr=1000"], 784.0, 1.0)):
        record(tmp_path, f"s0_{name}", overrides if "sparse" in name else [*overrides, *PARA], a_bits, b=(b,))
    lines = batch_lines_of(tmp_path)
    assert lines[1].endswith("`sparse` loses 15 bits against `memory`'s 30 (mean over seed(s) 0): met.")


def batch_lines_of(root):
    from memlm.studies.continual_fronts import batch_lines

    bases, sweep, _ = report.load_study(root)
    return batch_lines(bases, sweep)


def test_each_batch_shape_is_judged_on_its_own_runs_and_named_as_what_it_is(tmp_path):
    """The study's batch, a packed batch of 8 rows x 1,200 steps (the same tokens) and Lin et al.'s paraphrase
    batches: goal (b) per shape, each front over that shape's runs; a shape where one mode has no run is not
    compared."""
    packed = ["data.micro_batch=8", "steps=1200"]
    record(tmp_path, "base_s0", [], 800.0)
    sparse = ["finetune=sparse", "finetune.optimizer=sgd", "finetune.top_t=500"]
    runs = {"memory_a": ([*MEMORY, "memory.value_lr=100"], 798.0, 0.5),  # the study's batch: values-only loses 2-6
            "memory_b": ([*MEMORY, "memory.value_lr=300"], 794.0, 1.0),
            "sparse_a": ([*sparse, "memory.value_lr=300"], 790.0, 0.5),  # sparse 10-30
            "sparse_b": ([*sparse, "memory.value_lr=1000"], 770.0, 1.0),
            "memory_c": ([*MEMORY, "memory.value_lr=100", *packed], 780.0, 0.5),  # 8 rows: values-only 20-60
            "memory_d": ([*MEMORY, "memory.value_lr=300", *packed], 740.0, 1.0),
            "sparse_c": ([*sparse, "memory.value_lr=300", *packed], 796.0, 0.5),  # sparse 4-12
            "sparse_d": ([*sparse, "memory.value_lr=1000", *packed], 788.0, 1.0),
            "sparse_e": ([*sparse, "memory.value_lr=1000", *PARA], 788.0, 1.0)}  # no values-only run at this shape
    for name, (overrides, a_bits, b) in runs.items():
        record(tmp_path, f"s0_{name}", overrides, a_bits, b=(b,))
    lines = batch_lines_of(tmp_path)
    heads = [line for line in lines if line.startswith("- ")]
    assert heads == [
        "- Goal (b) at 16,384 slots, the study's batch (32 rows x 300 steps): `sparse` tuned over 2 setting(s); "
        "`memory` tuned over 2 setting(s).",
        "- Goal (b) at 16,384 slots, the batch of 8 rows x 1,200 steps: `sparse` tuned over 2 setting(s); "
        "`memory` tuned over 2 setting(s)."]
    assert lines[1].endswith("`sparse` loses 28 bits against `memory`'s 6 (mean over seed(s) 0): not met.")
    # below and beside the levels: each sparse run a values-only run at the same batch beats on both axes
    assert lines[3] == ("  - seed 0: 2 of `sparse`'s 2 run(s) at this batch beaten on both axes by a `memory` run: "
                        "top_t 500, sgd lr 300 (50.0% of the bits, 10 lost) by sgd lr 100 (50.0%, 2); top_t 500, "
                        "sgd lr 1000 (100.0% of the bits, 30 lost) by sgd lr 300 (100.0%, 6).")
    assert lines[5].endswith("`sparse` loses 11 bits against `memory`'s 56 (mean over seed(s) 0): met.")
    assert len(lines) == 7  # at 8 rows no sparse run is beaten on both: no such line


def test_a_seed_read_on_runs_at_another_batch_shape_says_so(tmp_path):
    """A mode's front spans every batch shape it ran at: where a seed's reading comes from runs at a shape
    that is not the study's batch (its other seed ran the study's), the line names the shape."""
    record(tmp_path, "base_s0", [], 800.0)
    record(tmp_path, "base_s1", [], 800.0, seed=1)
    record(tmp_path, "s0_memory_lr10", [*MEMORY, "memory.value_lr=10"], 792.0, b=(0.5,))  # lost 8
    record(tmp_path, "s0_memory_lr100", [*MEMORY, "memory.value_lr=100"], 776.0, b=(1.0,))  # lost 24
    record(tmp_path, "s1_memory_para_lr10", [*MEMORY, "memory.value_lr=10", *PARA], 784.0, b=(0.5,), seed=1)
    record(tmp_path, "s1_memory_para_lr100", [*MEMORY, "memory.value_lr=100", *PARA], 768.0, b=(1.0,), seed=1)
    bases, sweep, _ = report.load_study(tmp_path)
    assert level_lines(bases, sweep)[1] == (  # 8 + 0.9 * 16 = 22.4; 16 + 0.9 * 16 = 30.4
        "  - `memory`: mean 26 over 2 seed(s) (seed 0: 22 (EM 95.0%); seed 1: 30 (EM 95.0%, read on runs of "
        "8 paraphrase rows (facts_b_para) x 2,400 steps))")
