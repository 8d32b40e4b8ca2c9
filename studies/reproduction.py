"""Does a run trained again reproduce its record? The study driver's check and the report's summary of it.

    problem, check = reproduction_problem(recorded, again, within=0.02)  # two summary.json dicts
    # problem: None, or "bits:facts_a.stored_bits 31,000 against 31,954; ..."; check: which case it was in
    largest_deviation(recorded["evals"], again["evals"])                  # 0.0 where every figure is equal
    reproduced(record_dir, evals, within)  # a record folder's rerun as the report states it, or None
    reproduction_lines(bases, sweep, within)  # the continual report's lines, one per record trained again

Runs on CPU are deterministic: where the record's commit, torch, CPU and vector unit are the rerun's
(memlm.machine.same_environment) its evaluations must be equal. Elsewhere (another commit, another machine)
each evaluation figure must lie within `within` of the record's (the study plan's `reproduce_within`), a
tolerance the record's conclusions do not depend on; the check says which case it made.
"""

from __future__ import annotations

import json
from pathlib import Path

from memlm.machine import same_environment
from memlm.studies.formats import percent

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


def reproduced(record: Path, evals: dict, within: float) -> dict | None:
    """The record's rerun (`--stage reproduce` keeps its summary.json beside the record), as the report
    states it: where each ran and how far its evaluations lie from the record's."""
    again_file = record / REPRODUCED
    if not again_file.exists():
        return None
    recorded = json.loads((record / "summary.json").read_text())
    again = json.loads(again_file.read_text())
    problem, _ = reproduction_problem(recorded, again, within)
    return {"then": recorded.get("environment") or {}, "now": again.get("environment") or {},
            "bitwise": same_environment(recorded.get("environment"), again.get("environment")),
            "deviation": largest_deviation(evals, again.get("evals") or {}), "ok": problem is None}


def _where(env: dict) -> str:
    commit = str(env["commit"])[:7] if env.get("commit") else "a commit not recorded"
    vector = env.get("cpu_capability") or "vector unit not recorded"
    return f"{commit} ({env.get('cpu') or 'CPU not recorded'}, {vector})"


def reproduction_lines(bases: dict[tuple[int, int], dict], sweep: list[dict], within: float) -> list[str]:
    """One line per continual-study record (the report's rows, `reproduced` set) trained again by
    `python -m memlm.launch.continual_study --stage reproduce`."""
    base_names = {b["name"] for b in bases.values()}
    again = sorted((r for r in [*bases.values(), *sweep] if r["reproduced"]),
                   key=lambda r: (r["slots"], r["seed"], r["name"] not in base_names, r["name"]))
    if not again:
        return []
    out = ["", "Records trained again from scratch, the rerun's summary kept beside the record "
               f"({REPRODUCED}; `python -m memlm.launch.continual_study --stage reproduce` trains a size's base and "
               "each mode's best setting again, from that base): equal evaluations are asked where the commit, "
               f"torch, CPU and vector unit match, else every figure within {percent(within)}.", ""]
    for r in again:
        x = r["reproduced"]
        what = "base" if r["name"] in base_names else f"{r['mode']}, {r['setting']}"
        verdict = "reproduces" if x["ok"] else "does NOT reproduce"
        check = "equal asked" if x["bitwise"] else f"within {percent(within)} asked"
        how_far = ("every evaluation figure equal" if x["deviation"] == 0.0
                   else f"largest difference in an evaluation figure {x['deviation']:.2%}")
        out.append(f"- `{r['name']}` ({r['slots']:,} slots, seed {r['seed']}, {what}): recorded at "
                   f"{_where(x['then'])}, trained again at {_where(x['now'])}; {check}: {verdict} ({how_far}).")
    return out
