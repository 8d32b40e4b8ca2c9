"""A rerun against its record (memlm.studies.reproduction): which check applies, and what counts as off."""

from __future__ import annotations

import pytest

from memlm.studies.reproduction import largest_deviation, reproduction_problem

HERE = {"commit": "a" * 40, "dirty": False, "torch": "2.13.0", "cpu": "AMD EPYC", "cpu_capability": "AVX512"}
EVALS = {"bits:facts_a": {"stored_bits": 100.0, "exact_match": 0.5}, "ppl:bio_heldout": {"token_ppl": 2.0}}


def _summary(evals, env=HERE):
    return {"evals": evals, "environment": env}


def test_same_environment_asks_equality_elsewhere_every_figure_within_the_share():
    off = {**EVALS, "ppl:bio_heldout": {"token_ppl": 2.02}}  # 1% off
    problem, check = reproduction_problem(_summary(EVALS), _summary(off), 0.02)
    assert problem is not None and check.endswith("equal evaluations asked")
    problem, check = reproduction_problem(_summary(EVALS), _summary(off, {**HERE, "commit": "b" * 40}), 0.02)
    assert problem is None and check.endswith("every figure within 2% asked")
    assert largest_deviation(EVALS, off) == pytest.approx(0.01)


def test_a_figure_the_rerun_lacks_is_a_problem_not_a_pass():
    elsewhere = {**HERE, "commit": "b" * 40}
    problem, _ = reproduction_problem(_summary(EVALS), _summary({"bits:facts_a": EVALS["bits:facts_a"]}, elsewhere),
                                      0.02)
    assert problem == "ppl:bio_heldout.token_ppl missing (recorded 2.0)"
    problem, _ = reproduction_problem(_summary(EVALS), {"environment": elsewhere}, 0.02)  # no evals at all
    assert problem is not None and problem.count("missing") == 3
