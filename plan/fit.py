"""`python -m memlm.plan --fit` and `--paper`: plan every layout a run could
take (power-of-two memory_parallel x fsdp mode x the least activation
checkpointing that fits) and rank the ones that fit, fastest first.

    plans = fit(cfg, world=64)
    print(format_fit(plans))
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from memlm.config.run import Config, compose
from memlm.distributed.value_layout import GPUS, memory_parallel_candidates
from memlm.plan.cost import HBM_HEADROOM
from memlm.plan.planner import PAPER, PAPER_COMMON, PAPER_WORLDS, check_args, override_keys, plan
from memlm.plan.report import gib, short_bytes


def fit_candidates(cfg: Config, world: int) -> list[int]:
    """memory_parallel values to try: powers of two dividing the world and the
    value widths (only 1 without memory layers: nothing to shard)."""
    widths = [cfg.memory.v_dim or cfg.model.dim] if cfg.memory.kind != "none" else []
    if cfg.memory.engram.layers:  # Engram's tables split by columns too
        widths.append(cfg.memory.engram.head_dim)
    return memory_parallel_candidates(world, *widths)


CHECKPOINTS = ("none", "selective", "full")  # least recompute (fastest) first


def with_layout(cfg: Config, memory_parallel: int, fsdp: str, checkpoint: str) -> Config:
    """A validated copy of `cfg` with these parallel settings."""
    layout = copy.deepcopy(cfg)
    layout.parallel.memory_parallel, layout.parallel.fsdp = memory_parallel, fsdp
    layout.parallel.activation_checkpoint = checkpoint
    layout.validate()
    return layout


def fit(cfg: Config, world: int, gpu: str = "H200", gpus_per_node: int = 8, fsdp_modes: tuple[str, ...] = (),
        checkpoints: tuple[str, ...] = (), shape: dict[str, Any] | None = None,
        on_plan: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """The plans of every layout tried: each candidate memory_parallel
    (smallest first) x each of `fsdp_modes`, at the first of `checkpoints` that
    fits (more recompute is never faster) or, when none does, at each of them.
    Empty `fsdp_modes` / `checkpoints`: the config's own. Without value tables
    memory_parallel changes nothing, so only the first candidate is planned.
    `on_plan(plan)`: called as each layout's plan is done (the CLI's progress lines)."""
    fsdp_modes = fsdp_modes or (cfg.parallel.fsdp,)
    checkpoints = checkpoints or (cfg.parallel.activation_checkpoint,)
    check_args(with_layout(cfg, 1, cfg.parallel.fsdp, cfg.parallel.activation_checkpoint), world, 0,
               gpus_per_node, gpu)
    plans = []
    for p in fit_candidates(cfg, world):
        for mode in fsdp_modes:
            for checkpoint in checkpoints:
                layout = with_layout(cfg, p, mode, checkpoint)
                plans.append(plan(layout, world, 0, gpu, gpus_per_node, shape))
                if on_plan is not None:
                    on_plan(plans[-1])
                if plans[-1]["fits"]:
                    break
        if plans[-1]["slots"] == 0:
            break
    return plans


FIT_COLUMNS = ("memory_parallel", "fsdp", "activation_checkpoint", "GiB/GPU", "step s", "tokens/s/GPU", "MFU",
               "memory all-to-all/step", "value-grad reduce/step")


def layout_overrides(p: dict[str, Any]) -> str:
    return (f"parallel.memory_parallel={p['memory_parallel']} parallel.fsdp={p['fsdp']} "
            f"parallel.activation_checkpoint={p['activation_checkpoint']}")


def format_fit(plans: list[dict[str, Any]]) -> str:
    """The layouts that did not fit (one line), one table of those that fit,
    fastest first, and a last line naming the fastest and its overrides."""
    first = plans[0]
    where = f"{first['world']} x {first['gpu']}"
    fitting = sorted((p for p in plans if p["fits"]),
                     key=lambda p: (p["time"]["step_s"], p["bytes"]["total"], p["memory_parallel"]))
    lines = []
    if first["slots"] == 0 and first["memory_kind"] != "none":
        lines.append(f"memory={first['memory_kind']} has no value tables: memory_parallel changes nothing, "
                     "planned at 1 only")
    fitted = {(p["memory_parallel"], p["fsdp"]) for p in fitting}
    missed: dict[str, list[str]] = {}
    for p in plans:
        sizes = missed.setdefault(p["fsdp"], [])
        if (p["memory_parallel"], p["fsdp"]) not in fitted and str(p["memory_parallel"]) not in sizes:
            sizes.append(str(p["memory_parallel"]))
    missed = {mode: sizes for mode, sizes in missed.items() if sizes}
    if missed:
        tried = "/".join(dict.fromkeys(p["activation_checkpoint"] for p in plans))
        lines.append(f"does not fit at any activation_checkpoint tried ({tried}): "
                     + "; ".join(f"fsdp {mode} with memory_parallel {', '.join(ps)}" for mode, ps in missed.items()))
    if not fitting:
        best = min(plans, key=lambda p: p["bytes"]["total"])
        lines.append(f"nothing fits on {where}: the smallest is {gib(best['bytes']['total'])} GiB per GPU "
                     f"({layout_overrides(best)}) of {gib(GPUS[best['gpu']].hbm_bytes * HBM_HEADROOM)} GiB usable; "
                     "try more GPUs (--world), a larger --gpu, a smaller data.micro_batch or data.seq_len, "
                     "or fewer memory slots")
        return "\n".join(lines)
    rows = [FIT_COLUMNS]
    for p in fitting:
        t, c = p["time"], p["comm_bytes"]
        rows.append((str(p["memory_parallel"]), p["fsdp"], p["activation_checkpoint"], gib(p["bytes"]["total"]),
                     f"{t['step_s']:.4g}", f"{t['tokens_per_s']:,.0f}", f"{t['mfu']:.1%}",
                     short_bytes(c["memory_all_to_all"]), short_bytes(c["value_grad_reduce"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(FIT_COLUMNS))]
    lines.append(f"{len(fitting)} {'layout fits' if len(fitting) == 1 else 'layouts fit'} on {where}, "
                 f"fastest first (estimated; GiB/GPU of {gib(GPUS[first['gpu']].hbm_bytes * HBM_HEADROOM)} "
                 "usable):")
    lines += ["  " + "  ".join(v.rjust(w) if i in (0, 3, 4, 5, 6) else v.ljust(w)
                               for i, (v, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
    best = fitting[0]
    train_with = " ".join([layout_overrides(best), *best["shape"]["train_with"]])
    t = best["time"]
    lines.append(f"use: memory_parallel {best['memory_parallel']}, fsdp {best['fsdp']}, activation_checkpoint "
                 f"{best['activation_checkpoint']} ({t['step_s']:.4g} s/step, MFU {t['mfu']:.1%}): add {train_with}")
    return "\n".join(lines)


def paper_table(gpu: str, gpus_per_node: int, extra: list[str] = ()) -> str:
    """The docs/scaling-plan.md table: each paper setting on 8, 64 and 512 GPUs.
    Memory columns at the smallest memory_parallel that fits (or the largest
    tried); every power-of-two memory_parallel that fits; the fastest of them."""
    rows = ["| setting | GPUs | smallest P that fits | params | grads | optimizer | activations | total | "
            "memory_parallel that fit | fastest P | step s | MFU |", "|" + "---|" * 12]
    for name, overrides in PAPER:
        for world in PAPER_WORLDS:
            plans = fit(compose([*PAPER_COMMON, *overrides, *extra]), world, gpu, gpus_per_node)
            fitting = [p for p in plans if p["fits"]]
            p = fitting[0] if fitting else plans[-1]
            fast = min(fitting or plans, key=lambda q: q["time"]["step_s"])
            b, act = p["bytes"], p["bytes"]["activations"]
            fit_list = ", ".join(str(q["memory_parallel"]) for q in fitting) or "none"
            rows.append(
                f"| {name} | {world} | {p['memory_parallel'] if fitting else 'none'} | {gib(b['params'])} | "
                f"{gib(b['grads'])} | {gib(b['optimizer'])} | "
                f"{gib(act['saved'] + act['recompute'] + act['transient'])} | "
                f"{gib(b['total'])}{'' if fitting else ' (P=' + str(p['memory_parallel']) + ')'} | {fit_list} | "
                f"{fast['memory_parallel'] if fitting else '-'} | {fast['time']['step_s']:.2f} | "
                f"{fast['time']['mfu']:.1%} |")
    return "\n".join(rows)


def fit_knobs(overrides: list[str], cfg: Config, world: int, gpus_per_node: int) -> tuple[tuple[str, ...], ...]:
    """(fsdp modes, activation checkpoints) for --fit to try: the config's own
    where an override sets one; hybrid only when the world spans whole nodes."""
    given = override_keys(overrides)
    if "parallel.fsdp" in given or world <= gpus_per_node or world % gpus_per_node:
        modes: tuple[str, ...] = (cfg.parallel.fsdp,)
    else:
        modes = ("full", "hybrid")
    checkpoints = (cfg.parallel.activation_checkpoint,) if "parallel.activation_checkpoint" in given else CHECKPOINTS
    return modes, checkpoints
