"""Equal learning read off each mode's front: the continual study's comparison in bits on both axes.

    from memlm.studies.continual_fronts import front, at_level, level_lines
    points = front(rows)               # one mode's runs at one table size and seed -> its front, by learning
    lost = at_level(points, 0.95)      # (facts-A bits lost, EM beside) at 95% of facts B's bits, or the reason not
    read = readings(bases, sweep, 0.95)  # {slots: {mode: {seed: Reading}}}
    mean_lost(read[slots][mode])       # the mean over the seeds that reach the level, or None
    lines = level_lines(bases, sweep)  # the report's lines: per size and level, each mode per seed and the mean
    table = front_table(bases, sweep)  # every front's runs: learned, lost, EM and held-out perplexity change
    batch = batch_lines(bases, sweep)  # goal (b) per batch shape (Lin et al.'s too): sparse against values-only

A run's learning is the share of facts B's corpus bits it stored (b_bits / b_corpus); its forgetting
is the facts-A bits it lost against its base (base a_bits - a_bits). Bits on both axes, so learning
and forgetting are measured in one unit; exact match on facts B is shown beside.

A mode's front (at one table size and seed) is its runs that no other run of the mode beats on both
(learns as much or more and loses as little or less); sorted by learning, its losses rise too. At a
level L the loss is interpolated linearly between the two front runs whose learning brackets L, and
never beyond them: a front whose runs all learn less than L does not reach it, one whose runs all
learn more is not bracketed below it. Such a seed is reported with its reason, not averaged.
"""

from __future__ import annotations

from dataclasses import dataclass

from memlm.studies.continual_plan import batch_words, is_paraphrase_batch, is_study_batch, plan


@dataclass(frozen=True)
class Point:
    """One run on the learning/forgetting plane."""

    setting: str
    learned: float  # facts B's bits stored, as a share of its corpus bits
    lost: float  # facts-A bits lost against the base
    b_em: float  # facts-B exact match, shown beside
    ppl_change: float  # held-out perplexity over the base's, minus 1
    batch: tuple  # its batch shape (continual_plan.batch_shape)


@dataclass(frozen=True)
class Reading:
    """A front read at a level: the loss (and EM) interpolated there, or why it cannot be."""

    lost: float | None
    b_em: float | None
    why_not: str = ""
    batches: tuple = ()  # the batch shapes of the runs it was read between, sorted


def point(row: dict, base: dict) -> Point:
    """A sweep row of the continual report (load_study) against its base's row."""
    return Point(row["setting"], row["b_bits"] / row["b_corpus"], base["a_bits"] - row["a_bits"], row["b_em"],
                 row["ppl"] / base["ppl"] - 1, row["batch"])


def fronts(bases: dict[tuple[int, int], dict], rows: list[dict]) -> dict[tuple[int, int, str], list[Point]]:
    """(slots, seed, mode) -> that mode's front over `rows` (sweep rows of one or more sizes and seeds)."""
    keys = sorted({(r["slots"], r["seed"], r["mode"]) for r in rows},
                  key=lambda k: (k[0], k[1], plan().report_order.index(k[2])))
    return {(slots, seed, mode): front([point(r, bases[slots, seed]) for r in rows
                                        if (r["slots"], r["seed"], r["mode"]) == (slots, seed, mode)])
            for slots, seed, mode in keys}


def front(points: list[Point]) -> list[Point]:
    """The points no other point beats on both learning (higher) and loss (lower), by learning."""
    def beaten(p: Point) -> bool:
        return any(o.learned >= p.learned and o.lost <= p.lost and (o.learned, o.lost) != (p.learned, p.lost)
                   for o in points)

    kept: dict[tuple[float, float], Point] = {}
    for p in points:
        if not beaten(p):
            kept.setdefault((p.learned, p.lost), p)  # equal points: the first
    return sorted(kept.values(), key=lambda p: p.learned)


def at_level(points: list[Point], level: float) -> Reading:
    """The front's loss at `level` of facts B's bits learned, interpolated between the two runs that
    bracket it (a run exactly at the level: its own loss)."""
    if not points:
        return Reading(None, None, "no runs")
    if level > points[-1].learned:
        return Reading(None, None, f"does not reach it (at most {points[-1].learned:.1%})")
    if level < points[0].learned:
        return Reading(None, None, f"not bracketed (its least-learning run learns {points[0].learned:.1%})")
    for lo, hi in zip(points, points[1:] + points[-1:]):
        if lo.learned <= level <= hi.learned:
            t = 0.0 if hi.learned == lo.learned else (level - lo.learned) / (hi.learned - lo.learned)
            return Reading(lo.lost + t * (hi.lost - lo.lost), lo.b_em + t * (hi.b_em - lo.b_em), "",
                           tuple(sorted({lo.batch, hi.batch})))
    raise AssertionError("unreachable: the level lies within the front's learning")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def readings(bases: dict[tuple[int, int], dict], sweep: list[dict], level: float
             ) -> dict[int, dict[str, dict[int, Reading]]]:
    """slots -> mode -> seed -> that front read at `level` of facts B's bits learned."""
    out: dict[int, dict[str, dict[int, Reading]]] = {}
    for (slots, seed, mode), points in fronts(bases, sweep).items():
        out.setdefault(slots, {}).setdefault(mode, {})[seed] = at_level(points, level)
    return out


def read_words(r: Reading) -> str:
    """A reading in words: the loss with the EM there, and the batch shapes it was read between where they
    are not the study's batch (a mode's front spans every batch shape it ran at: a seed that ran a shape
    the other did not is read on other runs)."""
    if r.lost is None:
        return r.why_not
    other = "" if all(is_study_batch(b) for b in r.batches) else \
        f", read on runs of {' and '.join(batch_words(b) for b in r.batches)}"
    return f"{r.lost:,.0f} (EM {r.b_em:.1%}{other})"


def mean_lost(by_seed: dict[int, Reading]) -> float | None:
    """The mean facts-A bits lost over the seeds whose front reaches the level (None: none does)."""
    reached = [r.lost for r in by_seed.values() if r.lost is not None]
    return _mean(reached) if reached else None


def level_lines(bases: dict[tuple[int, int], dict], sweep: list[dict]) -> list[str]:
    """Per table size and level (plan().levels): each mode's facts-A bits lost at that learning, per
    seed and as the mean of the seeds that reach it, and the plan's reference mode over the best of
    the rest (by that mean): the ratio of their means over the seeds where both reach the level, and
    per seed."""
    out = []
    hi = plan().reference
    for slots in sorted({r["slots"] for r in sweep}):
        seeds = sorted({r["seed"] for r in sweep if r["slots"] == slots})
        for level in plan().levels:
            read = readings(bases, sweep, level).get(slots)
            if not read:
                continue
            out.append(f"- At {level:.0%} of facts B's bits learned ({slots:,} slots), facts-A bits lost "
                       "(interpolated on each mode's front; facts-B EM there in brackets):")
            means = {m: v for m, by_seed in read.items() if (v := mean_lost(by_seed)) is not None}
            for mode, by_seed in read.items():
                reached = [r for r in by_seed.values() if r.lost is not None]
                each = "; ".join(f"seed {s}: {read_words(r)}" for s, r in by_seed.items())
                mean = f"mean {means[mode]:,.0f} over {len(reached)} seed(s)" if reached else "no seed reaches it"
                out.append(f"  - `{mode}`: {mean} ({each})")
            rest = {m: v for m, v in means.items() if m != hi}
            if hi in read and hi not in means:
                out.append(f"  - `{hi}` / the best of the rest: not measured, no seed of `{hi}` reaches this level "
                           f"(goal (a) at equal learning, at least {plan().ratio_at_least:g}x: open).")
            if hi in means and not rest and len(read) > 1:
                out.append(f"  - `{hi}` / the best of the rest: not measured, no other mode's front is read at this "
                           f"level (goal (a) at equal learning, at least {plan().ratio_at_least:g}x: open).")
            if hi in means and rest:
                best = min(rest, key=rest.get)
                # The ratio over the seeds where both read: means over other seeds would compare other draws.
                both = [s for s in seeds if s in read[hi] and s in read[best]
                        and read[hi][s].lost is not None and read[best][s].lost is not None]
                if not both:
                    out.append(f"  - `{hi}` / `{best}` (the best of the rest): no seed where both reach it.")
                    continue
                lost_hi, lost_best = (_mean([read[m][s].lost for s in both]) for m in (hi, best))
                if lost_best <= 0:
                    out.append(f"  - `{best}` (the best of the rest) loses no facts-A bits on average over seed(s) "
                               f"{', '.join(map(str, both))}: `{hi}` / `{best}` has no finite ratio.")
                    continue
                per_seed = [f"seed {s}: {read[hi][s].lost / read[best][s].lost:.1f}x" for s in both
                            if read[best][s].lost > 0]
                out.append(f"  - `{hi}` / `{best}` (the best of the rest) over seed(s) {', '.join(map(str, both))}: "
                           f"{lost_hi / lost_best:.1f}x" + (f" ({'; '.join(per_seed)})" if len(both) > 1 else "")
                           + f" (goal (a): at least {plan().ratio_at_least:g}x: "
                           f"{'met' if lost_hi / lost_best >= plan().ratio_at_least else 'not met'}).")
    return out


def front_table(bases: dict[tuple[int, int], dict], sweep: list[dict]) -> list[str]:
    """Every mode's front per table size and seed, one row per run on it, by learning: the points the
    level lines interpolate between, with each run's held-out perplexity against its base's."""
    out = ["", "Each mode's front per table size and seed (its runs that no other run of the mode beats on both "
           "facts B's bits learned and facts A's bits lost; by learning), with the held-out perplexity against "
           "the base's:", "",
           "| slots | seed | mode | setting | facts B bits learned | facts B EM | facts A bits lost | held-out ppl |",
           "|---:|---:|---|---|---:|---:|---:|---:|"]
    for (slots, seed, mode), points in fronts(bases, sweep).items():
        out += [f"| {slots:,} | {seed} | {mode} | {p.setting} | {p.learned:.1%} | {p.b_em:.1%} | {p.lost:,.0f} | "
                f"{p.ppl_change:+.1%} |" for p in points]
    return out if len(out) > 5 else []


def batch_label(batch: tuple) -> str:
    """A fine-tune's batch shape (a report row's "batch": continual_plan.batch_shape) in words."""
    if is_paraphrase_batch(batch):
        return f"Lin et al.'s batch shape ({batch_words(batch)}: one fact's paraphrases a batch)"
    if is_study_batch(batch):
        return f"the study's batch ({batch_words(batch)})"
    return f"the batch of {batch_words(batch)}"


def batch_lines(bases: dict[tuple[int, int], dict], sweep: list[dict]) -> list[str]:
    """Goal (b) within each batch shape: per table size, batch shape (where both modes ran) and level, the
    plan's `less` pair (sparse, then values-only) each read on its front over its runs at that shape only,
    per seed; met where the first loses no more than the second over the seeds where both reach the level,
    else what kept it from being read. The selection's claim is about which rows a batch changes, so it is
    compared batch by batch: a batch that reads less of the table is where it can differ from every row."""
    first, second = plan().less
    rows = [r for r in sweep if r["mode"] in (first, second)]
    out = []
    for slots in sorted({r["slots"] for r in rows}):
        for batch in sorted({r["batch"] for r in rows if r["slots"] == slots}, key=lambda b: (b[2], -b[0], b[1])):
            at = [r for r in rows if (r["slots"], r["batch"]) == (slots, batch)]
            tuned = {m: sorted({r["setting"] for r in at if r["mode"] == m}) for m in (first, second)}
            if not all(tuned.values()):
                continue
            out.append(f"- Goal (b) at {slots:,} slots, {batch_label(batch)}: "
                       + "; ".join(f"`{m}` tuned over {len(t)} setting(s)" for m, t in tuned.items()) + ".")
            out += _pair_at_levels(bases, at, first, second)
            out += _beaten_lines(bases, at, first, second)
    return out


def _beaten_lines(bases: dict[tuple[int, int], dict], rows: list[dict], first: str, second: str) -> list[str]:
    """Per seed, the first mode's runs at this batch that one of the second's beats on both axes (learns at
    least as much and loses no more, not the same point), each beside the second's run that loses least
    of those: where the first's front stops short of a level, this reads the two at equal conditions
    below it."""
    out = []
    for seed in sorted({r["seed"] for r in rows}):
        base = bases[rows[0]["slots"], seed]
        mine = sorted((r for r in rows if (r["seed"], r["mode"]) == (seed, first)), key=lambda r: r["b_bits"])
        theirs = [r for r in rows if (r["seed"], r["mode"]) == (seed, second)]
        pairs = []
        for r in mine:
            p = point(r, base)
            better = [(q, o) for o in theirs for q in [point(o, base)]
                      if q.learned >= p.learned and q.lost <= p.lost and (q.learned, q.lost) != (p.learned, p.lost)]
            if better:
                q, o = min(better, key=lambda pair: pair[0].lost)
                pairs.append(f"{r['tuned']} ({p.learned:.1%} of the bits, {p.lost:,.0f} lost) by {o['tuned']} "
                             f"({q.learned:.1%}, {q.lost:,.0f})")
        if pairs:
            out.append(f"  - seed {seed}: {len(pairs)} of `{first}`'s {len(mine)} run(s) at this batch beaten on "
                       f"both axes by a `{second}` run: " + "; ".join(pairs) + ".")
    return out


def _pair_at_levels(bases: dict[tuple[int, int], dict], rows: list[dict], first: str, second: str) -> list[str]:
    every = fronts(bases, rows)
    seeds = sorted({r["seed"] for r in rows})
    slots = rows[0]["slots"]
    out = []
    for level in plan().levels:
        read = {m: {s: at_level(every.get((slots, s, m), []), level) for s in seeds} for m in (first, second)}
        each = "; ".join(f"`{m}` " + ", ".join(f"seed {s}: " + (f"{r.lost:,.0f} bits lost (EM {r.b_em:.1%})"
                                                               if r.lost is not None else r.why_not)
                                              for s, r in by_seed.items()) for m, by_seed in read.items())
        both = [s for s in seeds if read[first][s].lost is not None and read[second][s].lost is not None]
        if both:
            a, b = (_mean([read[m][s].lost for s in both]) for m in (first, second))
            verdict = (f"`{first}` loses {a:,.0f} bits against `{second}`'s {b:,.0f} (mean over seed(s) "
                       f"{', '.join(map(str, both))}): {'met' if a <= b else 'not met'}")
        elif any(read[second][s].lost is not None for s in seeds):
            verdict = f"not met: `{first}`'s front at this batch does not reach the level where `{second}`'s does"
        else:
            verdict = f"not measured: `{second}`'s front at this batch does not reach the level"
        out.append(f"  - at {level:.0%} of facts B's bits learned: {each}; {verdict}.")
    return out
