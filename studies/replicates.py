"""Pool repeated runs of one config (other seeds) into one row with means.

A small model trained for many passes over a fact corpus moves its held-out
exact match by several points between seeds (docs/results.md, "Runs"),
so the ablation report compares means over independent runs. Runs are the
same config when their saved config.yaml files agree on everything except
the fields listed in RUN_IDENTITY.
"""

from __future__ import annotations

import hashlib
import json
import statistics

import yaml

# Fields that name or place a run, or pick its random draws: they may differ
# between replicates of one config. Everything else must match.
RUN_IDENTITY = ("name", "dump_dir", "seed", "data.seed", "data.cache_dir", "logging", "checkpoint")
# Row fields averaged over a group's runs (None where a run lacks the figure).
AVERAGED = ("final_loss", "val_loss", "usage", "seconds")


def _with_defaults(config_yaml: str) -> dict:
    """A saved config with the fields it predates filled in from the current
    schema: a switch added later defaults to the behaviour before it (e.g.
    memory.value_init_scale 1.0, the published init), so a run saved before
    the switch existed is the same config as one saved after. A config the
    current schema cannot read (a field since removed) is taken as saved."""
    from omegaconf import OmegaConf

    from memlm.config.run import Config

    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(config_yaml))
        return OmegaConf.to_container(merged, resolve=True)
    except Exception:  # noqa: BLE001 - any schema mismatch: fall back to the text as saved
        return yaml.safe_load(config_yaml)


def identity_config(config_yaml: str) -> tuple[dict, tuple[int, int]]:
    """(config without its RUN_IDENTITY fields, (seed, data.seed)) of a saved
    run config, read through the current schema (`_with_defaults`)."""
    cfg = _with_defaults(config_yaml)
    seeds = int(cfg.get("seed", 0)), int(cfg.get("data", {}).get("seed", 0))
    for dotted in RUN_IDENTITY:
        *parents, leaf = dotted.split(".")
        node = cfg
        for part in parents:
            node = node.get(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(leaf, None)
    return cfg, seeds


def config_key(cfg: dict) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


def run_identity(config_yaml: str) -> tuple[str, tuple[int, int]]:
    """(config key, (seed, data.seed)) of a saved run config: the key is a
    digest of `identity_config`."""
    cfg, seeds = identity_config(config_yaml)
    return config_key(cfg), seeds


def _same_result(a: dict, b: dict, metrics: tuple[str, ...]) -> bool:
    return all(a.get(m) == b.get(m) for m in (*metrics, "val_loss", "final_loss"))


def independent(runs: list[dict], metrics: tuple[str, ...]) -> list[dict]:
    """Drop a run that repeats another's seeds and every result exactly: a
    rerun of unchanged code, not another draw (a rerun at the same seeds whose
    results differ, e.g. after a change of summation order, is kept)."""
    kept: list[dict] = []
    for run in runs:
        if not any(k["seeds"] == run["seeds"] and _same_result(k, run, metrics) for k in kept):
            kept.append(run)
    return kept


def seeds_cell(runs: list[dict]) -> str:
    """A table cell naming each run's (init, data order) seeds: `0,0 / 1,1`."""
    return " / ".join(f"{a},{b}" for a, b in (r["seeds"] for r in runs))


def mean_present(values: list) -> float | None:
    """Mean of the values that are not None (None when there are none)."""
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def pool(primary: list[dict], extra: list[dict], metrics: tuple[str, ...]) -> tuple[list[dict], list[dict]]:
    """One row per config of `primary`, averaged over its independent runs in
    primary + extra. Returns (pooled rows in primary's order, extra runs that
    match no primary config). Each pooled row keeps its runs under "runs"."""
    groups: dict[str, list[dict]] = {}
    for run in primary + extra:
        groups.setdefault(run["key"], []).append(run)
    wanted = {r["key"] for r in primary}
    pooled, seen = [], set()
    for first in primary:
        if first["key"] in seen:
            continue
        seen.add(first["key"])
        runs = independent(sorted(groups[first["key"]], key=lambda r: r["seeds"]), metrics)  # stable: primary first
        row = {**first, "runs": runs, "n_runs": len(runs)}
        for field in (*metrics, *AVERAGED):
            row[field] = mean_present([r.get(field) for r in runs])
        pooled.append(row)
    return pooled, [r for r in extra if r["key"] not in wanted]
