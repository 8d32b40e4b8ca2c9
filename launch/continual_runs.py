"""The continual-learning study's runs: their names, overrides and the run each starts from, as the plan
(configs/studies/continual.yaml) lays them out. Pure: nothing here trains (memlm.launch.continual_study
does, run by run).

    series = Series(seed=0, n_keys=1024)                      # the runs from one base model
    base = base_run(series)                                   # k1024_base_s0, dump in runs/continual/
    sweep = sweep_runs(series, base)                          # the plan's sweep at that size, from the base
    best = best_setting(sweep, "memory")                      # the recorded run the rounds and seeds repeat
    rounds = round_runs(series, base, best, rounds=5)         # each from the round before
    run.command(), run.dump, run.record, final_checkpoint(run)
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from memlm.config.run import compose
from memlm.studies.continual_plan import finetune_config, plan

DATA = Path("data_cache/continual")
RUNS = Path("runs/continual")
AGAIN = Path("runs/continual_again")  # --stage reproduce: reruns beside the study's own runs, never over them
RECORDS = Path("docs/runs/continual")
SGD = "finetune.optimizer=sgd"  # left out of run names: the sweep's default for the value tables


@dataclass(frozen=True)
class Series:
    """The runs from one base model: its seed and its table size (memory.n_keys; None: the
    experiment's own, whose runs keep the study's first, unprefixed names)."""

    seed: int
    n_keys: int | None = None

    @property
    def prefix(self) -> str:
        return f"k{self.n_keys}_" if self.n_keys else ""

    @property
    def table(self) -> list[str]:
        """The override every run of the series carries: a fine-tune's model is its base's."""
        return [f"memory.n_keys={self.n_keys}"] if self.n_keys else []

    def at_seed(self, seed: int) -> Series:
        return Series(seed, self.n_keys)


@dataclass
class Run:
    name: str
    overrides: list[str]
    mode: str = ""  # a fine-tune's mode; "" for a base model
    setting: tuple[str, ...] = ()  # a sweep run's overrides besides its mode, seed and paths
    start: Run | None = None  # the run whose final checkpoint this one starts from (init_from)
    background_of: Run | None = None  # the base whose batch background it ranks against (tfidf_batches)
    root: Path = RUNS  # where its dump goes: the study's runs, or AGAIN for a reproduction

    @property
    def dump(self) -> Path:
        return self.root / self.name

    @property
    def record(self) -> Path:
        return RECORDS / self.name

    def command(self) -> str:
        return "python -m memlm.train " + " ".join(shlex.quote(o) for o in self.overrides)


def _label(overrides: list[str] | tuple[str, ...]) -> str:
    keep = [o.split("=", 1) for o in overrides if o != SGD]
    # A path is named by its folder (data.sources.0.path=.../facts_b_para/train.jsonl -> pathfacts_b_para).
    return "_".join(f"{k.rsplit('.', 1)[-1]}{Path(v).parent.name if '/' in v else v}" for k, v in keep
                    if not k.startswith(("seed", "init_from", "dump")))


def base_run(series: Series, root: Path = RUNS) -> Run:
    name = f"{series.prefix}base_s{series.seed}"
    return Run(name, ["experiment=continual_base", *series.table, f"seed={series.seed}", f"dump_dir={root / name}"],
               root=root)


def final_checkpoint(run: Run) -> Path:
    """Where `run`'s last checkpoint lies: its recorded step count, or the configured one before it ran (its
    command's `steps`, else its experiment's: a base not recorded yet)."""
    if (run.record / "summary.json").exists():
        steps = json.loads((run.record / "summary.json").read_text())["steps"]
    else:
        named = dict(o.split("=", 1) for o in run.overrides)
        steps = int(named["steps"]) if "steps" in named else compose(list(run.overrides)).steps
    return run.dump / "checkpoints" / f"step_{steps:08d}"


def ranks_by_batches(setting: tuple[str, ...] | list[str]) -> bool:
    """Whether a setting's finetune.ranking counts background batches (memlm.memory.slot_selection.BY_BATCHES):
    its background is then the base's over the plan's `background_batches` (`batch_background`)."""
    from memlm.memory.slot_selection import BY_BATCHES

    return dict(o.split("=", 1) for o in setting).get("finetune.ranking") in BY_BATCHES


def batch_background(base: Run) -> Path:
    """The background a `tfidf_batches` setting ranks against: the base's final model over the plan's
    `background_batches` pretraining batches (each a document of Lin et al.'s TF-IDF), beside its final
    checkpoint. The base's own recorded background (its last steps, `slot_usage.safetensors`) counts
    fewer batches, while the model still trained."""
    return final_checkpoint(base) / f"slot_usage_{plan().background_batches}_batches.safetensors"


def ranks_against(base: Run, mode: str, setting: tuple[str, ...] | list[str],
                  from_base: bool) -> tuple[list[str], Run | None]:
    """(the finetune.background override, the base whose batch background must exist first) of a run of
    `mode` with `setting`. A run `from_base` that ranks against what the base recorded names nothing: a
    fine-tune's default is the file in its init_from folder."""
    from memlm.finetune.background import FILE
    from memlm.finetune.modes import MODES

    if ranks_by_batches(setting):
        return [f"finetune.background={batch_background(base)}"], base
    if "background" in MODES[mode].reads and not from_base:
        return [f"finetune.background={final_checkpoint(base) / FILE}"], None
    return [], None


def sweep_run(series: Series, base: Run, mode: str, setting: tuple[str, ...]) -> Run:
    name = f"{series.prefix}s{series.seed}_{mode}_{_label(setting)}"
    background, of = ranks_against(base, mode, setting, from_base=True)
    return Run(name, ["experiment=continual_finetune", *series.table, f"finetune={mode}", *setting,
                      f"seed={series.seed}", *background, f"init_from={final_checkpoint(base)}",
                      f"dump_dir={base.root / name}"],
               mode, setting, base, of, base.root)


def sweep_runs(series: Series, base: Run) -> list[Run]:
    """The plan's sweep at the series' table size (the experiment's own where the series names none) and seed."""
    n_keys = series.n_keys or finetune_config().memory.n_keys
    return [sweep_run(series, base, mode, setting) for mode, setting in plan().sweep_of(n_keys, series.seed)]


def facts_b_exact_match(run: Run) -> tuple[float, float]:
    """(facts-B exact match, facts-A stored bits) of a finished run's last evaluation."""
    results = json.loads((run.record / "summary.json").read_text())["evals"]
    return results["bits:facts_b"]["exact_match"], results["bits:facts_a"]["stored_bits"]


def best_setting(runs: list[Run], mode: str) -> Run | None:
    """The mode's run that kept the most facts-A bits among those that learned facts B (else the best learner)."""
    done = [r for r in runs if r.mode == mode and (r.record / "summary.json").exists()]
    if not done:
        return None
    learned = [r for r in done if facts_b_exact_match(r)[0] >= plan().learned]
    if learned:
        return max(learned, key=lambda r: facts_b_exact_match(r)[1])
    return max(done, key=lambda r: facts_b_exact_match(r)[0])


def round_runs(series: Series, base: Run, best: Run, rounds: int) -> list[Run]:
    mode = best.mode
    # The setting's batch shape goes with it: its rows (one paraphrase per row, file order) and size.
    settings = [o for o in best.setting if o.startswith(("finetune.", "memory.", "optim.", "data.micro_batch=",
                                                         "data.rows=", "data.shuffle=", "data.seq_len="))]
    label = _label(settings)  # in the name: a later sweep that picks another best setting does not reuse these
    # A setting with its own steps (a smaller batch, more steps) keeps its share per round.
    swept = dict(o.split("=", 1) for o in best.setting)
    steps = plan().round_steps * int(swept.get("steps", finetune_config().steps)) // finetune_config().steps
    evals = ",".join(f'"bits:facts_b{r + 1}"' for r in range(rounds))
    from memlm.data.continual import paraphrase_folder

    # A setting trained on facts B's paraphrases takes each round's paraphrases.
    para = swept.get("data.sources.0.path", "").endswith(f"/{paraphrase_folder('facts_b')}/train.jsonl")
    runs, start = [], base
    for r in range(1, rounds + 1):
        name = f"{series.prefix}s{series.seed}_rounds_{mode}_{label}_r{r}"
        # Every round ranks against the base's background, for a mode that reads one (the others refuse
        # a setting they ignore); round 1, from the base, names it too: the rounds read alike.
        background, of = ranks_against(base, mode, settings, from_base=False)
        run = Run(name, ["experiment=continual_finetune", *series.table, f"finetune={mode}", *settings,
                         f"seed={series.seed}", f"steps={steps}",
                         f"data.sources.0.path={DATA}/{paraphrase_folder(f'facts_b{r}') if para else f'facts_b{r}'}"
                         "/train.jsonl",
                         "checkpoint.at_end=true", *background,
                         f"eval.tasks=[{evals},\"bits:facts_a\",\"ppl:bio_heldout\",\"qa:bio_qa\"]",
                         f"init_from={final_checkpoint(start)}", f"dump_dir={base.root / name}"],
                  mode, tuple(settings), start, of, base.root)
        runs.append(run)
        start = run
    return runs
