"""The continual-learning study's plan: configs/studies/continual.yaml, read by the study's driver
(`python -m memlm.launch.continual_study`, which runs it) and by its report
(`python -m memlm.studies.continual_report`, which judges the runs against its goals).

`plan()` is the file as a `Plan` (each mode checked against memlm.finetune.modes), read when a
command first needs it; `load_plan(path)` reads another file; `finetune_config()` is the study's
fine-tune as configured (configs/experiment/continual_finetune.yaml); `batch_shape(cfg)` is a fine-tune's
batch shape, `batch_words(shape)` it in words and `is_study_batch(shape)` whether it is that fine-tune's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

from memlm.config.run import CONFIG_DIR, compose
from memlm.errors import ConfigError

PLAN_FILE = CONFIG_DIR / "studies" / "continual.yaml"


@dataclass(frozen=True)
class Plan:
    """configs/studies/continual.yaml: the study's sweep, rounds and goals."""

    learned: float  # facts-B exact match a setting must reach to count as having learned them
    levels: tuple[float, ...]  # shares of facts B's bits learned at which the report reads each mode's front
    round_steps: int
    background_batches: int  # the pretraining batches a finetune.ranking=tfidf_batches setting's background counts
    round_modes: tuple[str, ...]
    report_order: tuple[str, ...]
    reference: str  # goal (a): its facts-A loss over the best of the other modes' ...
    ratio_at_least: float  # ... is at least this
    less: tuple[str, str]  # goal (b): the first mode loses less than the second
    rounds_kept: float  # goal (c): the share of its bits the oldest round keeps after the last one
    lost_at_most: dict[int, float]  # goal (d): slots -> the share of facts A the best of the other modes may lose
    heldout_within: float  # goal (e): that setting's held-out perplexity and QA within this share of its base's
    reproduce_within: float  # a run retrained elsewhere (another commit, torch or CPU): its evals within this share
    sweep: tuple[tuple[str, tuple[str, ...]], ...]  # (mode, the entry's other overrides)
    sweep_at: dict[int, tuple[tuple[str, tuple[str, ...]], ...]]  # n_keys -> entries run at that size only
    sweep_only_at: dict[int, tuple[tuple[str, tuple[str, ...]], ...]]  # n_keys -> that size's whole sweep
    later_seeds_at: dict[int, tuple[tuple[str, tuple[str, ...]], ...]]  # n_keys -> what seeds > 0 run of it

    def sweep_of(self, n_keys: int, seed: int = 0) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """The sweep at a table size (memory.n_keys) and seed: a later seed's list where the plan gives one,
        else the size's own list where it has one, else the common sweep and the size's added entries."""
        if seed > 0 and n_keys in self.later_seeds_at:
            return self.later_seeds_at[n_keys]
        if n_keys in self.sweep_only_at:
            return self.sweep_only_at[n_keys]
        return (*self.sweep, *self.sweep_at.get(n_keys, ()))


def load_plan(path: Path = PLAN_FILE) -> Plan:
    """The study plan at `path`, each mode checked against memlm.finetune.modes."""
    from memlm.finetune.modes import MODES

    raw = yaml.safe_load(path.read_text())

    def mode(value: object, key: str) -> str:
        if value not in MODES:
            raise ConfigError(f"{path}: {key}", value, f"not a fine-tune mode; valid: {', '.join(MODES)}")
        return str(value)

    def entries(raw_entries: list, key: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
        out = []
        for i, entry in enumerate(raw_entries):
            named = [o.split("=", 1)[1] for o in entry if o.startswith("finetune=")]
            if len(named) != 1:
                raise ConfigError(f"{path}: {key}[{i}]", entry,
                                  f"names {len(named)} modes; each entry needs one finetune=<mode>")
            out.append((mode(named[0], f"{key}[{i}]"), tuple(o for o in entry if not o.startswith("finetune="))))
        return tuple(out)

    levels = tuple(float(x) for x in raw.get("levels") or ())
    if not levels or not all(0 < x <= 1 for x in levels):
        raise ConfigError(f"{path}: levels", raw.get("levels"), "a list of shares of facts B's bits in (0, 1]")
    goals = raw["goals"]
    both = sorted(set(raw.get("sweep_at") or {}) & set(raw.get("sweep_only_at") or {}))
    if both:
        raise ConfigError(f"{path}: sweep_only_at", both, "sizes not also under sweep_at: a size's own sweep "
                                                           "replaces the common one and sweep_at's entries")
    batches = raw.get("background_batches")
    if not isinstance(batches, int) or batches < 1:
        raise ConfigError(f"{path}: background_batches", batches, "an integer >= 1 (pretraining batches)")
    sweep_at = {int(n): entries(e, f"sweep_at.{n}") for n, e in (raw.get("sweep_at") or {}).items()}
    sweep_only_at = {int(n): entries(e, f"sweep_only_at.{n}") for n, e in (raw.get("sweep_only_at") or {}).items()}
    common = entries(raw["sweep"], "sweep")
    later_seeds_at = {}
    for n, raw_entries in (raw.get("later_seeds_at") or {}).items():
        later = entries(raw_entries, f"later_seeds_at.{n}")
        at_seed_0 = sweep_only_at.get(int(n)) or (*common, *sweep_at.get(int(n), ()))
        for i, entry in enumerate(later):
            if entry not in at_seed_0:  # a later seed's front is read beside seed 0's: the same settings
                raise ConfigError(f"{path}: later_seeds_at.{n}[{i}]", list(entry[1]),
                                  f"not an entry of this size's seed-0 sweep (finetune={entry[0]}); a later "
                                  "seed repeats seed 0's settings")
        later_seeds_at[int(n)] = later
    return Plan(learned=float(raw["learned"]), levels=levels, round_steps=int(raw["round_steps"]),
                background_batches=batches,
                round_modes=tuple(mode(m, "round_modes") for m in raw["round_modes"]),
                report_order=tuple(mode(m, "report_order") for m in raw["report_order"]),
                reference=mode(goals["reference"], "goals.reference"),
                ratio_at_least=float(goals["ratio_at_least"]),
                less=(mode(goals["less"][0], "goals.less"), mode(goals["less"][1], "goals.less")),
                rounds_kept=float(goals["rounds_kept"]),
                lost_at_most={int(k): float(v) for k, v in (goals.get("lost_at_most") or {}).items()},
                heldout_within=float(goals["heldout_within"]),
                reproduce_within=float(raw.get("reproduce_within", 0.0)), sweep=common, sweep_at=sweep_at,
                sweep_only_at=sweep_only_at, later_seeds_at=later_seeds_at)


@functools.cache
def plan() -> Plan:
    """The plan of configs/studies/continual.yaml, read when a command first needs it (inside its
    entry point: a bad edit of the file is one line naming the entry, not an import traceback)."""
    return load_plan()


@functools.cache
def finetune_config():
    """The study's fine-tune as configured (configs/experiment/continual_finetune.yaml): its steps, of
    which a round takes the plan's `round_steps`, and its batch, which a run's setting names where it
    differs."""
    return compose(["experiment=continual_finetune"])


def batch_shape(cfg) -> tuple[int, int, str, str]:
    """A fine-tune's batch shape: (rows a batch, steps, its `data.rows` layout, its corpus's folder)."""
    return cfg.data.micro_batch, cfg.steps, cfg.data.rows, Path(cfg.data.sources[0].path).parent.name


def is_study_batch(shape: tuple[int, int, str, str]) -> bool:
    """Whether a batch shape is the study's fine-tune's (its corpus aside: facts B in rounds is the same batch)."""
    return shape[:3] == batch_shape(finetune_config())[:3]


def is_paraphrase_batch(shape: tuple[int, int, str, str]) -> bool:
    """Whether a batch shape has one document a row: with the paraphrase corpus, one fact's paraphrases a
    batch (Lin et al.'s shape)."""
    return shape[2] == "documents"


def batch_words(shape: tuple[int, int, str, str]) -> str:
    """A batch shape in words: "32 rows x 300 steps", or with one document a row (the paraphrase corpus:
    one fact's paraphrases a batch) "8 paraphrase rows (facts_b_para) x 2,400 steps"."""
    rows, steps, layout, corpus = shape
    if is_paraphrase_batch(shape):
        return f"{rows} paraphrase rows ({corpus}) x {steps:,} steps"
    return f"{rows} rows x {steps:,} steps"
