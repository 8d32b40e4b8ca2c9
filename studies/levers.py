"""Lever runs: one config change against the study run of the same seeds.

The paper names the levers of a memory layer (value learning rate, qk-norm,
knn, number and placement of memory layers, value init). A lever run is a
study config with a change (e.g. `memory.value_lr=0.03`) trained at seeds the
study also ran. Runs of one config differ by several points between seeds
(docs/results.md, "Runs"), so each lever run is compared with the study run
of the same seeds (paired), and a lever's effect is the mean of those
differences, next to the spread of the study config itself.
"""

from __future__ import annotations

from collections.abc import Callable

from memlm.studies.replicates import mean_present, seeds_cell


def flatten(cfg: dict, prefix: str = "") -> dict:
    """Nested config -> {dotted key: leaf value}."""
    out = {}
    for key, value in cfg.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{dotted}."))
        else:
            out[dotted] = value
    return out


def changes(lever: dict, base: dict) -> dict:
    """{dotted key: lever's value} where two flattened configs differ."""
    keys = sorted(set(lever) | set(base))
    return {k: lever.get(k) for k in keys if lever.get(k) != base.get(k)}


def change_label(diff: dict) -> str:
    # As typed on a command line: memory.qk_norm=false, not False.
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in diff.items())


def _kind(row: dict) -> str:
    # What replaces the FFN: a lever tunes a variant, it does not make another one.
    return row["config"].get("memory.kind", "")


def lever_rows(study: list[dict], runs: list[dict], metrics: tuple[str, ...]) -> list[dict]:
    """One row per lever config. `study`: pooled rows (each with "config",
    flattened, and its independent "runs"); `runs`: the lever runs (each with
    "config", "key", "seeds" and results). Each lever run is set against the
    study config it differs from least and, per seed pair, the mean of that
    config's runs at those seeds (None when the study has none)."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(run["key"], []).append(run)
    rows = []
    for members in groups.values():
        members = sorted(members, key=lambda r: r["seeds"])
        # The study config of the same variant (memory.kind: Memory+ for a
        # Memory+ lever, even where another variant's config differs in as few
        # keys) that differs least; the first one on a tie.
        same = [s for s in study if _kind(s) == _kind(members[0])] or study
        base = min(same, key=lambda s: len(changes(members[0]["config"], s["config"])))
        paired = []
        for run in members:
            same = [r for r in base["runs"] if r["seeds"] == run["seeds"]]
            paired.append({m: mean_present([r.get(m) for r in same]) if same else None for m in (*metrics, "val_loss")})
        rows.append({"change": change_label(changes(members[0]["config"], base["config"])), "base": base,
                     "runs": members, "paired": paired})
    return rows


def _delta(row: dict, metric: str) -> float | None:
    deltas = [r.get(metric) - p[metric] for r, p in zip(row["runs"], row["paired"])
              if r.get(metric) is not None and p[metric] is not None]
    return sum(deltas) / len(deltas) if deltas else None


def levers_table(rows: list[dict], label: Callable[[dict], str], em_seen: str, em_trained: str, phrasings: str,
                 pct: Callable, num: Callable) -> list[str]:
    """Markdown: per lever its runs, the paired study runs and the mean paired change."""
    out = ["| change | of | seeds | EM seen % (study, same seeds) | mean change | "
           "EM trained phrasing % (study) | mean change | held-out phrasings answered % (study) | val loss (study) |",
           "|---|---|---|---|---:|---|---:|---|---|"]

    def pairs(row: dict, metric: str, fmt: Callable) -> str:
        return " / ".join(f"{fmt(r.get(metric))} ({fmt(p[metric])})" for r, p in zip(row["runs"], row["paired"]))

    def signed(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:+.1f}"

    for row in rows:
        out.append(f"| {row['change']} | {label(row['base'])} | {seeds_cell(row['runs'])} | {pairs(row, em_seen, pct)} "
                   f"| {signed(_delta(row, em_seen))} | {pairs(row, em_trained, pct)} "
                   f"| {signed(_delta(row, em_trained))} "
                   f"| {pairs(row, phrasings, pct)} | {pairs(row, 'val_loss', lambda x: num(x, '.4f'))} |")
    return out


def _same_compute(row: dict) -> bool:
    # A tuning change keeps the study's tokens and costs no more FLOPs/token;
    # a longer run (steps=6000) is another budget, not a tuned config.
    base = row["base"]
    return all(r.get("tokens") == base.get("tokens") and r.get("flops", 0) <= base.get("flops", 0)
               for r in row["runs"])


def _tried(study_row: dict, rows: list[dict]) -> list[dict]:
    """The levers of one study config that count as tuning it (same compute)."""
    return [r for r in rows if r["base"]["key"] == study_row["key"] and _same_compute(r)]


def tuned_rows(study: list[dict], rows: list[dict], metric: str) -> list[dict]:
    """Per study config, the best tried config at the same compute: the lever
    with the largest mean paired change of `metric`, or the study config itself
    when no lever gains. Its estimated mean is the study mean plus that change
    (the study's seeds, not only the lever's, whose draws differ by several
    points). The best of several tries by the metric it is judged on is an
    optimistic estimate, the more so the more tries."""
    out = []
    for s in study:
        tried = _tried(s, rows)
        scored = [(d, r) for r in tried if (d := _delta(r, metric)) is not None]
        delta, best = max(scored, key=lambda x: x[0]) if scored else (None, None)
        if delta is not None and delta <= 0:
            delta, best = 0.0, None  # no lever gained: the study config is the best tried
        value = s.get(metric)
        out.append({**s, "tries": len(tried), "lever": best, "delta": delta,
                    metric: None if value is None else value + (delta or 0.0), "study_value": value})
    return out


def tuned_table(rows: list[dict], label: Callable[[dict], str], metric: str, pct: Callable) -> list[str]:
    """Markdown: per variant the levers tried, the best one and the estimated mean."""
    out = ["| variant | levers tried | best tried config | its runs (seeds) | mean paired change | "
           "study mean | estimated mean |", "|---|---:|---|---|---:|---:|---:|"]
    for row in rows:
        lever = row["lever"]
        change = lever["change"] if lever else "the study config"
        seeds = seeds_cell(lever["runs"]) if lever else "-"
        delta = "-" if row["delta"] is None else f"{100 * row['delta']:+.1f}"
        out.append(f"| {label(row)} | {row['tries']} | {change} | {seeds} | {delta} "
                   f"| {pct(row['study_value'])} | {pct(row.get(metric))} |")
    return out


def lr_grid(study: list[dict], rows: list[dict], metric: str) -> tuple[list[float], list[dict]]:
    """The learning rate is the one lever every variant has, so it is the
    axis on which the tuning budgets can be made equal. Per study config and
    per learning rate tried (the study's own or a lever's, at the same
    compute), the best estimated mean of `metric` (study mean + mean paired
    change, as in `tuned_rows`) and how many configs were tried at that rate.
    Returns (the rates in ascending order, one row per study config with
    "cells": {lr: (estimate, tries)})."""
    rates: set[float] = set()
    out = []
    for s in study:
        value = s.get(metric)
        cells: dict[float, list[float | None]] = {s["config"]["optim.lr"]: [value]}
        for row in _tried(s, rows):
            delta = _delta(row, metric)
            cells.setdefault(row["runs"][0]["config"]["optim.lr"], []).append(
                None if value is None or delta is None else value + delta)
        rates |= set(cells)
        best = {lr: (max((x for x in xs if x is not None), default=None), len(xs)) for lr, xs in cells.items()}
        out.append({**s, "cells": best})
    return sorted(rates), out


def lr_grid_table(rates: list[float], rows: list[dict], label: Callable[[dict], str], pct: Callable) -> list[str]:
    """Markdown: per variant, the best estimated mean at each learning rate (tries in brackets)."""
    out = ["| variant | " + " | ".join(f"lr {lr:g}" for lr in rates) + " |", "|---|" + "---:|" * len(rates)]
    for row in rows:
        cells = [f"{pct(row['cells'][lr][0])} ({row['cells'][lr][1]})" if lr in row["cells"] else "-"
                 for lr in rates]
        out.append(f"| {label(row)} | " + " | ".join(cells) + " |")
    return out
