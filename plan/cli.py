"""`python -m memlm.plan`: the scale planner's command line (plan/planner.py
says what it computes; plan/fit.py what --fit and --paper add)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from memlm.distributed.value_layout import GPUS
from memlm.errors import entry_point
from memlm.plan import planner
from memlm.plan.cost import gpu_spec
from memlm.plan.fit import fit, fit_candidates, fit_knobs, format_fit, layout_overrides, paper_table, with_layout
from memlm.plan.planner import check_args, plan, planning_config
from memlm.plan.report import format_plan, format_shape


class Progress:
    """--fit's line per layout planned, on stderr (a plan takes seconds; --fit plans up to dozens)."""

    def __init__(self):
        self.start, self.done = time.perf_counter(), 0

    def __call__(self, p: dict) -> None:
        self.done += 1
        verdict = f"fits, {p['time']['step_s']:.3g} s/step" if p["fits"] else "does not fit"
        print(f"[fit] layout {self.done}: {layout_overrides(p)}: {verdict} ({time.perf_counter() - self.start:.0f} s)",
              file=sys.stderr, flush=True)


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memlm.plan", description=planner.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=8, help="number of GPUs (ranks)")
    parser.add_argument("--rank", type=int, default=0, help="the rank to plan (0 holds the largest FSDP shards)")
    parser.add_argument("--gpu", default="H200", help=f"one of: {', '.join(GPUS)}")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--fit", action="store_true",
                        help="try every power-of-two memory_parallel, fsdp mode and activation checkpointing "
                             "the overrides leave open; print the layouts that fit, fastest first")
    parser.add_argument("-v", "--verbose", action="store_true", help="--fit: also print each layout's full plan")
    parser.add_argument("--paper", action="store_true",
                        help="the docs/scaling-plan.md table (overrides apply to every setting)")
    parser.add_argument("--json", action="store_true", help="print the plan(s) as JSON")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=8b memory=memplus")
    args = parser.parse_intermixed_args(argv)  # overrides may come before or after the flags
    gpu_spec(args.gpu)
    if args.paper:
        print(paper_table(args.gpu, args.gpus_per_node, args.overrides))
        return 0
    cfg, shape = planning_config(args.overrides)
    if args.fit:
        check_args(with_layout(cfg, 1, cfg.parallel.fsdp, cfg.parallel.activation_checkpoint), args.world, 0,
                   args.gpus_per_node, args.gpu)
        modes, checkpoints = fit_knobs(args.overrides, cfg, args.world, args.gpus_per_node)
        if not args.json:
            print(f"fit: {cfg.model.name} + {cfg.memory.kind} on {args.world} x {args.gpu}, trying "
                  f"memory_parallel {', '.join(map(str, fit_candidates(cfg, args.world)))} x fsdp "
                  f"{'/'.join(modes)}, each at the first activation_checkpoint of "
                  f"{'/'.join(checkpoints)} that fits\n{format_shape(shape)}", flush=True)
        plans = fit(cfg, args.world, args.gpu, args.gpus_per_node, modes, checkpoints, shape, Progress())
    else:
        plans = [plan(cfg, args.world, args.rank, args.gpu, args.gpus_per_node, shape)]
    if args.json:
        print(json.dumps(plans, indent=2))
    elif not args.fit:
        print(format_plan(plans[0]))
    else:
        for p in plans if args.verbose else ():
            print("\n" + format_plan(p))
        print(("\n" if args.verbose else "") + format_fit(plans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
