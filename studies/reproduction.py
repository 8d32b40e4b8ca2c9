"""Does a run trained again reproduce its record? The study driver's check and the report's summary of it.

    problem, check = reproduction_problem(recorded, again, within=0.02)  # two summary.json dicts
    # problem: None, or "bits:facts_a.stored_bits 31,000 against 31,954; ..."; check: which case it was in
    largest_deviation(recorded["evals"], again["evals"])                  # 0.0 where every figure is equal

Runs on CPU are deterministic: where the record's commit, torch, CPU and vector unit are the rerun's
(memlm.machine.same_environment) its evaluations must be equal. Elsewhere (another commit, another machine)
each evaluation figure must lie within `within` of the record's (the study plan's `reproduce_within`), a
tolerance the record's conclusions do not depend on; the check says which case it made.
"""

from __future__ import annotations

from memlm.machine import same_environment

REPRODUCED = "reproduced_summary.json"  # a rerun's summary.json, kept beside the record it was checked against


def reproduction_problem(recorded: dict, again: dict, within: float) -> tuple[str | None, str]:
    """(what differs, or None; which check was made) between a record's summary.json and a rerun's."""
    then_evals, now_evals = recorded.get("evals") or {}, again.get("evals") or {}
    if same_environment(recorded.get("environment"), again.get("environment")):
        check = "the record's commit, torch, CPU and vector unit: equal evaluations asked"
        differs = None if now_evals == then_evals else f"evals {now_evals} against {then_evals}"
        return differs, check
    then, now = recorded.get("environment") or {}, again.get("environment") or {}
    check = (f"recorded at commit {str(then.get('commit'))[:12]}, torch {then.get('torch')}, CPU {then.get('cpu')} "
             f"({then.get('cpu_capability', 'vector unit not recorded')}); rerun at {str(now.get('commit'))[:12]}, "
             f"torch {now.get('torch')}, CPU {now.get('cpu')} ({now.get('cpu_capability')}): "
             f"every figure within {within:.0%} asked")
    far = [f"{key} {b} against {a}" for key, a, b in figures(then_evals, now_evals) if abs(b - a) > within * abs(a)]
    shared = {key for key, _, _ in figures(then_evals, now_evals)}
    lacking = [f"{key} missing (recorded {a})" for key, a, _ in figures(then_evals, then_evals) if key not in shared]
    return ("; ".join(far + lacking) or None), check


def largest_deviation(recorded: dict, again: dict) -> float:
    """The largest relative difference between two evaluation dicts' shared figures (0.0: all equal; a
    figure the rerun lacks is `reproduction_problem`'s to name)."""
    return max((abs(b - a) / abs(a) if a else float(b != a) for _, a, b in figures(recorded, again)), default=0.0)


def figures(a: dict, b: dict, prefix: str = ""):
    """(key, a's number, b's number) for every number both nested dicts hold at the same key."""
    for key, value in a.items():
        other = b.get(key) if isinstance(b, dict) else None
        if isinstance(value, dict):
            yield from figures(value, other or {}, f"{prefix}{key}.")
        elif isinstance(value, (int, float)) and isinstance(other, (int, float)) and not isinstance(value, bool):
            yield f"{prefix}{key}", float(value), float(other)
