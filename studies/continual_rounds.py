"""The continual study's rounds: facts B taught in equal entity groups, one round after another.

    from memlm.studies.continual_rounds import rounds_lines, kept
    lines = rounds_lines(rounds)  # the report's table and goal (c) lines (rows: continual_report.load_study)
    kept(rows)                     # {(earlier round, later round): share of its bits kept} of one chain

A round's run starts from the previous round's weights and evaluates every round's facts (its summary's
`bits:facts_b<i>`). Round i's retention after round j > i is the bits it stores after j over the bits it
stored just after it was taught (after round i): learning and keeping in one unit, bits. Goal (c) (#50:
"the oldest round keeps at least 95%") reads the oldest round after the last one (what a stream of
updates keeps of its first) against the plan's `rounds_kept`, per seed and as the mean over seeds; the
worst share any earlier round keeps after any later one is stated beside it.
"""

from __future__ import annotations

from memlm.studies.continual_plan import plan
from memlm.studies.formats import percent


def kept(rows: list[dict]) -> dict[tuple[int, int], float]:
    """{(i, j): round i's bits after round j / its bits after round i} for i < j, of one chain's rows
    (one table size, mode and seed; each row's "round" and "rounds": {i: evaluation of round i's facts})."""
    taught = {r["round"]: r["rounds"][r["round"]]["stored_bits"] for r in rows}
    return {(i, r["round"]): r["rounds"][i]["stored_bits"] / taught[i] for r in rows
            for i in r["rounds"] if i < r["round"] and taught.get(i)}


def _chains(rounds: list[dict]) -> dict[tuple[int, str, int], list[dict]]:
    """(slots, mode, seed) -> that chain's rows by round, in the report's mode order."""
    order = plan().report_order
    keys = sorted({(r["slots"], r["mode"], r["seed"]) for r in rounds}, key=lambda k: (k[0], order.index(k[1]), k[2]))
    return {k: sorted((r for r in rounds if (r["slots"], r["mode"], r["seed"]) == k), key=lambda r: r["round"])
            for k in keys}


def rounds_lines(rounds: list[dict]) -> list[str]:
    """The rounds table (every chain, each round's row) and goal (c) per chain."""
    if not rounds:
        return []
    n = max(max(r["rounds"]) for r in rounds)
    out = ["", f"Rounds: facts B taught in {n} rounds of equal entity groups, each starting from the previous "
           "round's weights; the share of each earlier round's bits kept after each later round (relative to just "
           "after it was taught), and facts A kept (of the base's bits).", "",
           "| slots | seed | mode | setting | after round | " + " | ".join(f"round {i} kept" for i in range(1, n + 1))
           + " | facts A kept |",
           "|---:|---:|---|---|---:|" + "---:|" * n + "---:|"]
    goals = []
    for (slots, mode, seed), rows in _chains(rounds).items():
        shares = kept(rows)
        for r in rows:
            cells = []
            for i in range(1, n + 1):
                if i == r["round"]:
                    cells.append(f"taught: EM {percent(r['rounds'][i]['exact_match'])}")
                else:
                    cells.append(percent(shares[i, r["round"]]) if (i, r["round"]) in shares else "-")
            out.append(f"| {slots:,} | {seed} | {mode} | {r['setting']} | {r['round']} | " + " | ".join(cells)
                       + f" | {percent(1 - r['forgetting'])} |")
        if shares:
            goals.append(_goal(slots, mode, seed, rows, shares))
    return out + [""] + goals + _mean_lines(rounds)


def _oldest(rows: list[dict]) -> float | None:
    """The share of its bits the chain's first round keeps after its last (None where not recorded)."""
    return kept(rows).get((rows[0]["round"], rows[-1]["round"]))


def _goal(slots: int, mode: str, seed: int, rows: list[dict], shares: dict[tuple[int, int], float]) -> str:
    first, last = rows[0]["round"], rows[-1]["round"]
    goal = plan().rounds_kept
    worst_at, worst = min(shares.items(), key=lambda kv: kv[1])
    oldest = shares.get((first, last))
    said = (f"round {first} keeps {percent(oldest)} of its bits after round {last}" if oldest is not None
            else f"round {first}'s bits after round {last} not recorded")
    met = oldest is not None and oldest >= goal
    return (f"- Goal (c), `{mode}` ({slots:,} slots, seed {seed}): {said}, at least {percent(goal)} asked: "
            f"{'met' if met else 'not met'}. The worst share of an earlier round kept after a later one is "
            f"{percent(worst)} (round {worst_at[0]} after round {worst_at[1]}).")


def _mean_lines(rounds: list[dict]) -> list[str]:
    """Goal (c) as the mean over seeds, per table size and mode run at more than one seed (each seed's chain
    read after the same last round)."""
    goal, out = plan().rounds_kept, []
    by_size: dict[tuple[int, str], dict[int, list[dict]]] = {}
    for (slots, mode, seed), rows in _chains(rounds).items():
        by_size.setdefault((slots, mode), {})[seed] = rows
    for (slots, mode), chains in by_size.items():
        lasts = {rows[-1]["round"] for rows in chains.values()}
        shares = {seed: _oldest(rows) for seed, rows in chains.items()}
        if len(chains) < 2 or len(lasts) > 1 or None in shares.values():
            continue  # one seed, or chains not yet at the same round: the per-seed lines say it
        mean = sum(shares.values()) / len(shares)
        each = ", ".join(f"seed {seed}: {percent(v)}" for seed, v in shares.items())
        out.append(f"- Goal (c), `{mode}` ({slots:,} slots, seeds {', '.join(map(str, shares))}): the oldest round "
                   f"keeps {percent(mean)} of its bits after round {lasts.pop()} (mean; {each}), at least "
                   f"{percent(goal)} asked: {'met' if mean >= goal else 'not met'}.")
    return out
