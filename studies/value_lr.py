"""The value-lr sweep of the knowledge-capacity report (memlm.studies.capacity_report).

    lines = section(rows, entities, runs_at)   # markdown: table, findings, commands
    panel(axes, rows, entities, runs_at)       # bits stored against memory.value_lr

The capacity study ran every product-key variant at one `memory.value_lr`
(its study value lr); the sweep reruns Memory and Memory+ at others, same
shapes, steps and exposures. Here each (variant, value lr) at the largest N
is one setting, its seeds averaged; a variant's best setting is the one
with the most bits stored among its settings with two or more seeds (among
all, where none has two), and the text names any one-seed setting above it:
one seed against a two-seed mean would pick the luckier seed. The order of the five variants at
their best settings is stated against the paper's.

`runs_at(variant, entities, value_lr)` returns the runs of one setting (one
per seed), as the report groups them; value_lr None means the study's.
A run that also sets one of the official code's levers (LEVER_DEFAULTS: value
weight decay, a bf16 table, W1/W2 biases) is no seed of any setting: the table "Levers"
sets it beside the same seed's run without it.
"""

from __future__ import annotations

from collections.abc import Callable

RunsAt = Callable[[str, int, float | None], list[dict]]
# The study's values of the official code's levers that a config reaches
# (issue #32): a run that sets another is a lever run, set beside the same
# seed's run without it and never averaged in as a seed of a setting.
LEVER_DEFAULTS = {"value_weight_decay": 0.0, "value_dtype": "fp32", "w_bias": False}
# The variants of the capacity study, by family label (memlm.model.family), in the report's order.
# Engram's rows (issue #51): alone, and beside Memory+ with 25% and 50% of its sparse budget.
ORDER = ["Dense", "MoE", "PEER", "Memory", "Memory+", "UltraMemV2", "Engram", "Engram 25% + Memory+",
         "Engram 50% + Memory+"]
PAPER_ORDER = "Memory+ > PEER > Memory > MoE > Dense"
GOAL_VS_DENSE = 5.0  # issues #32, #40: Memory+ at its default levers stores at least 5x Dense's bits (two-seed means)


def lever_of(memory_cfg) -> str:
    """The levers a run's memory config sets ("" for none), as overrides."""
    return " ".join(f"memory.{key}={getattr(memory_cfg, key)}" for key, study in LEVER_DEFAULTS.items()
                    if getattr(memory_cfg, key) != study)


def default_levers(kind: str = "memplus") -> str:
    """The levers `memory=<kind>` sets today (configs/memory/<kind>.yaml), as lever_of writes them:
    the setting the goal is judged at, whatever the records' defaults were when they ran."""
    from memlm.config.run import compose

    return lever_of(compose([f"memory={kind}", "memory.layers=[0]"]).memory)


def mean_bits(runs: list[dict]) -> float:
    return sum(r["stored_bits"] for r in runs) / len(runs)


def _spread(runs: list[dict]) -> float:
    """Bits stored by the best seed minus the worst."""
    return max(r["stored_bits"] for r in runs) - min(r["stored_bits"] for r in runs)


def said(runs: list[dict]) -> str:
    """Bits of one run, or the mean of several seeds with each seed's value."""
    if len(runs) == 1:
        return f"{runs[0]['stored_bits']:,.0f}"
    return f"{mean_bits(runs):,.0f} (mean of {len(runs)} seeds: " + ", ".join(
        f"{r['stored_bits']:,.0f}" for r in runs) + ")"


def said_bits(runs: list[dict]) -> str:
    """`said` with its unit, and the seed count where `said` does not give it (one run)."""
    return f"{said(runs)} bits" + (" (1 seed)" if len(runs) == 1 else "")


def settings(rows: list[dict], entities: int, runs_at: RunsAt) -> dict[str, list[tuple[float | None, list[dict]]]]:
    """variant -> [(value lr, runs)] at N, by value lr; variants without a value lr (Dense, MoE): [(None, runs)]."""
    out: dict[str, list[tuple[float | None, list[dict]]]] = {}
    for variant in ORDER:
        lrs = sorted({r["value_lr"] for r in rows if r["variant"] == variant and r["entities"] == entities
                      and r["value_lr"] is not None})
        found = [(lr, runs) for lr in (lrs or [None]) if (runs := runs_at(variant, entities, lr))]
        if found:
            out[variant] = found
    return out


def best(found: list[tuple]) -> tuple:
    """The setting with the most bits among those with two or more seeds (among all where none has);
    each setting is (its label or value lr, its runs)."""
    seeded = [item for item in found if len(item[1]) >= 2]
    return max(seeded or found, key=lambda item: mean_bits(item[1]))


def with_levers(variant: str, points: list[tuple[float | None, list[dict]]], levers: list[dict]) -> list[tuple]:
    """A variant's settings for the order: each value lr, and each lever setting (a value lr with
    a lever, its runs at every seed), labelled."""
    found = [(f"value lr {_lr(lr)}", runs) for lr, runs in points]
    groups: dict[tuple, list[dict]] = {}
    for r in levers:
        if r["variant"] == variant:
            groups.setdefault((r["value_lr"], r["lever"]), []).append(r)
    return found + [(f"value lr {_lr(lr)}, `{lever}`", runs) for (lr, lever), runs in groups.items()]


def goal_line(memplus: list[tuple], dense: list[dict]) -> str:
    """Memory+ against Dense at `memory=memplus`'s default levers, at the value lr where they store most.
    `memplus`: Memory+'s settings as with_levers lists them."""
    levers = default_levers()
    at_defaults = [item for item in memplus if item[1][0]["lever"] == levers]
    said_levers = f"`{levers}`" if levers else "none"
    if not at_defaults:
        return (f"- Memory+ at `memory=memplus`'s default levers ({said_levers}): not run yet, so the goal (at least "
                f"{GOAL_VS_DENSE:g}x Dense's bits) is NOT met.")
    _, runs = best(at_defaults)
    ratio = mean_bits(runs) / max(mean_bits(dense), 1e-9)
    seeds = (f"means over {len(runs)} and {len(dense)} seeds" if len(runs) >= 2
             else "one seed only: not yet a two-seed mean")
    return (f"- Memory+ at `memory=memplus`'s default levers ({said_levers}) and its best value lr there "
            f"({_lr(runs[0]['value_lr'])}) "
            f"stores {ratio:.2f}x Dense's bits ({seeds}; goal at least {GOAL_VS_DENSE:g}x): "
            f"{'met' if ratio >= GOAL_VS_DENSE and len(runs) >= 2 else 'NOT met'}.")


def spread_said(runs: list[dict]) -> str:
    """The seeds behind a mean: their number and spread (max - min)."""
    if len(runs) == 1:
        return "1 seed"
    return f"{len(runs)} seeds, spread {_spread(runs):,.0f}"


def _lr(lr: float | None) -> str:
    return "-" if lr is None else f"{lr:g}"


def section(rows: list[dict], entities: int, runs_at: RunsAt) -> list[str]:
    """The sweep's table, each variant's best setting, the order and the goal, and every run's command."""
    found = settings(rows, entities, runs_at)
    swept = {v: s for v, s in found.items() if len(s) >= 2}
    if not swept:
        return [f"- Value-lr sweep at N = {entities:,}: no variant was run at two value lrs yet."]
    out = [f"Value-lr sweep at N = {entities:,} (`memory.value_lr`; bits stored, mean over seeds):", "",
           "| variant | value lr | seeds | bits stored | EM % (mean) | runs |", "|---|---:|---:|---:|---:|---|"]
    for variant, points in swept.items():
        for lr, runs in points:
            em = 100 * sum(r["exact_match"] for r in runs) / len(runs)
            out.append(f"| {variant} | {_lr(lr)} | {len(runs)} | {said(runs)} | {em:.1f} "
                       f"| {', '.join(r['run'] for r in runs)} |")
    out.append("")
    for variant, points in swept.items():
        lr, runs = best(points)
        line = f"- {variant}'s best value lr at N = {entities:,}: {_lr(lr)}, {said_bits(runs)}"
        above = [(x, r) for x, r in points if len(r) < len(runs) and mean_bits(r) > mean_bits(runs)]
        if above:
            line += "; one-seed settings above it, unsettled until a second seed: " + ", ".join(
                f"{_lr(x)} ({mean_bits(r):,.0f})" for x, r in above)
        out.append(line + ".")
    lever_runs = [r for r in rows if r.get("lever") and r["entities"] == entities]
    tops = sorted(((v, *best(with_levers(v, points, lever_runs))) for v, points in found.items()),
                  key=lambda t: -mean_bits(t[2]))
    out.append(f"- Order at each variant's best setting at N = {entities:,}, levers included (mean bits; seeds "
               "and their spread; setting): "
               + " > ".join(f"{v} ({mean_bits(runs):,.0f}; {spread_said(runs)}; {label})" for v, label, runs in tops)
               + f"; the paper's order on NQ: {PAPER_ORDER}.")
    if "Memory+" in found and "Dense" in found:
        out.append(goal_line(with_levers("Memory+", found["Memory+"], lever_runs), best(found["Dense"])[1]))
    out += lever_lines(rows, entities, runs_at)
    levers = [r for r in rows if r.get("lever") and r["entities"] == entities]
    commands = [f"- `{r['run']}`: `{r['command']}`" for points in swept.values() for _, runs in points
                for r in runs if r.get("command")] + [f"- `{r['run']}`: `{r['command']}`" for r in levers
                                                      if r.get("command")]
    if commands:
        out += ["", "<details><summary>The command of every sweep run</summary>", "", *commands, "", "</details>"]
    return out


def set_against(variant: str, lr: float | None, lever: str, seeds: set[int], levers: list[dict], entities: int,
                runs_at: RunsAt) -> tuple[str, list[dict]]:
    """What a lever setting is set against at `seeds`: (the levers it keeps, their runs, one per seed
    where run). One lever: the sweep setting's own runs. Several: the same value lr with one lever
    fewer, the first such setting run at all of `seeds` (else the first of them), trying first to
    leave out the lever last in LEVER_DEFAULTS (the decay, studied first, is kept longest)."""
    mine = lever.split()
    found: list[tuple[str, list[dict]]] = []
    for drop in reversed(mine):
        kept = " ".join(x for x in mine if x != drop)
        pool = runs_at(variant, entities, lr) if not kept else [
            b for b in levers if (b["variant"], b["value_lr"], b["lever"]) == (variant, lr, kept)]
        found.append((kept, [b for b in pool if b["seed"] in seeds]))
    return next((f for f in found if len(f[1]) == len(seeds)), found[0])


def lever_lines(rows: list[dict], entities: int, runs_at: RunsAt) -> list[str]:
    """The lever runs at N, each against the same seed's run at the same value lr
    without the lever, and against Dense's mean over seeds."""
    levers = [r for r in rows if r.get("lever") and r["entities"] == entities]
    if not levers:
        return []
    dense = runs_at("Dense", entities, None)
    out = ["", f"Levers at N = {entities:,} (one change to a sweep setting, each against the same seed's run "
           "without it: the setting's own run, or for a second lever the run with the first):", "",
           "| variant | value lr | lever | seed | bits stored | EM % | same seed without it | change | x Dense | run |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in levers:
        kept, base = set_against(r["variant"], r["value_lr"], r["lever"], {r["seed"]}, levers, entities, runs_at)
        without = f"{base[0]['stored_bits']:,.0f}" + (f" (`{kept}`)" if kept else "") if base else "not run"
        change = f"{r['stored_bits'] / base[0]['stored_bits'] - 1:+.1%}" if base else "-"
        vs_dense = f"{r['stored_bits'] / mean_bits(dense):.2f}x" if dense else "-"
        out.append(f"| {r['variant']} | {_lr(r['value_lr'])} | `{r['lever']}` | {r['seed']} "
                   f"| {r['stored_bits']:,.0f} | {100 * r['exact_match']:.1f} | {without} | {change} | {vs_dense} "
                   f"| {r['run']} |")
    out += lever_means(levers, entities, runs_at, dense)
    spreads = [_spread(runs) for points in settings(rows, entities, runs_at).values() for _, runs in points
               if len(runs) >= 2]
    if spreads:
        out += ["", f"A lever's change is settled only over seeds, and it becomes a default when its mean beats "
                f"the same seeds' mean without it and each of its seeds beats that mean (two seeds of one setting "
                f"here differ by up to {max(spreads):,.0f} bits). x Dense: against Dense's mean over "
                f"{len(dense)} seed(s)."]
    return out


def lever_means(levers: list[dict], entities: int, runs_at: RunsAt, dense: list[dict]) -> list[str]:
    """One line per lever setting run at two or more seeds: its mean and spread against the mean of
    the same seeds without it, and whether the default rule holds."""
    groups: dict[tuple, list[dict]] = {}
    for r in levers:
        groups.setdefault((r["variant"], r["value_lr"], r["lever"]), []).append(r)
    out = []
    for (variant, lr, lever), every in groups.items():
        kept, base = set_against(variant, lr, lever, {r["seed"] for r in every}, levers, entities, runs_at)
        # The rule compares paired seeds only: a seed run with the lever alone (a third seed of
        # the setting the order turns on) has nothing to be set against.
        paired = {b["seed"] for b in base}
        runs = [r for r in every if r["seed"] in paired]
        if len(runs) < 2 or len(base) != len(runs):
            continue
        with_, without = mean_bits(runs), mean_bits(base)
        rule = all(r["stored_bits"] > without for r in runs) and with_ > without
        vs_dense = f", {with_ / mean_bits(dense):.2f}x Dense" if dense else ""
        against = f"`{kept}` alone" if kept else "without it"
        line = (f"- {variant}, value lr {_lr(lr)}, `{lever}` over seeds {', '.join(map(str, sorted(paired)))}: "
                f"mean {with_:,.0f} bits (spread {_spread(runs):,.0f}) against {without:,.0f} {against} "
                f"({with_ / without - 1:+.1%}{vs_dense}); each seed above the mean without it: "
                f"{'yes' if rule else 'no'}")
        if len(every) > len(runs):
            unpaired = sorted(r["seed"] for r in every if r["seed"] not in paired)
            line += (f". With seed{'s' if len(unpaired) > 1 else ''} {', '.join(map(str, unpaired))} (not run "
                     f"without it) the setting's mean over {len(every)} seeds is {mean_bits(every):,.0f} "
                     f"(spread {_spread(every):,.0f})")
        out.append(line + ".")
    return ["", *out] if out else []


def panel(axes, rows: list[dict], entities: int, runs_at: RunsAt) -> None:
    """Bits stored against value lr at N: each seed a dot, the mean a line, per swept variant; a lever run a star."""
    swept = {v: s for v, s in settings(rows, entities, runs_at).items() if len(s) >= 2}
    for variant, points in swept.items():
        lrs = [lr for lr, _ in points]
        (line,) = axes.plot(lrs, [mean_bits(runs) for _, runs in points], marker="o", label=variant)
        for lr, runs in points:
            axes.scatter([lr] * len(runs), [r["stored_bits"] for r in runs], color=line.get_color(), s=12,
                         alpha=0.5)
    for r in (r for r in rows if r.get("lever") and r["entities"] == entities):
        axes.scatter([r["value_lr"]], [r["stored_bits"]], marker="*", s=120, color="k", zorder=3,
                     label=f"{r['variant']}, {r['lever'].replace('memory.', '')} (seed {r['seed']})")
    axes.set(xscale="log", xlabel="memory.value_lr", ylabel="bits stored",
             title=f"value-lr sweep at N = {entities:,}")
    if swept:
        low, high = axes.get_ylim()
        axes.set_ylim(low, high + 0.35 * (high - low))  # room for the legend above the points
        axes.legend(loc="upper left", fontsize="small")
