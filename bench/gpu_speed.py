"""Issue #49's device run: the memory read's kernels and the 373M training step, measured side by side on one GPU.

    python bench/gpu_speed.py kernels --official .official --json OUT/speed_kernels.json --doc OUT/benchmarks.md
    python bench/gpu_speed.py sweep --json OUT/speed_sweep.json --doc OUT/benchmarks.md
    python bench/gpu_speed.py train --mode eager --sweep OUT/speed_sweep.json --json OUT/speed_train.json ...
    python bench/gpu_speed.py profile --sweep OUT/speed_sweep.json --json OUT/speed_profile.json ...
    python bench/gpu_speed.py train --mode compiled --sweep OUT/speed_sweep.json --json OUT/speed_train.json ...
    python bench/gpu_speed.py doc OUT --doc docs/benchmarks.md   # the section again from a run's JSON
    python bench/gpu_speed.py kernels --dry-run    # tiny shapes on CPU (TRITON_INTERPRET=1): checks the plumbing

bench/device_check.sh runs them as sections speed_kernels, speed_sweep,
speed_train, speed_profile and speed_compiled (SECTIONS="env speed"):

- kernels (bench/speed_kernels.py): at the paper's read, fp32 then bf16
  tables, every variant checked against a float32 F.embedding_bag, then
  timed fwd, bwd and fwd+bwd, beside a copy baseline, an L2-resident table
  and a hot-slot case; the official kernel (--official) beside ours.
  FAIL: one of ours raises or is off the reference, or (on a GPU)
  --official is missing.
- sweep (bench/launch_sweep.py): the "segments" launches at both dtypes,
  maxnreg, 1-warp and busiest-first backward programs included; the fastest
  of each pass and dtype is what the training parts run with (--sweep: as
  memory.triton_forward / triton_backward overrides, so each run's
  config.yaml records them). FAIL: a candidate raises or is off the reference.
- train: the 373M model, bf16 compute, 8 x 2,048 tokens: dense, Memory+
  with an fp32 table and with a bf16 table (1M slots, 3 layers sharing one
  pool); --mode eager or compiled (parallel.compile=true); tokens/s, MFU,
  peak memory (reset between models). Both modes go into one JSON.
  FAIL: a run raises or ends on a non-finite loss.
- profile (bench/speed_profile.py): one Memory+ step (fp32 table) and one
  dense step under torch.profiler, device time counted once and split:
  search, read forward and backward, the table's gradient sum, clipping,
  optimizer, the rest; the raw per-op and per-kernel tables go into the JSON.
  FAIL: a step raises or no device time was recorded.

Every part writes its JSON after each row (a timeout keeps what finished)
and its block of the "## GPU speed (bench/gpu_speed.py)" section of --doc
when it ends. The speed goals of issue #49 are printed as met / not met and
never fail a part. A dry run's figures are CPU timings, labelled so.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from gpu_speed_doc import GOAL_TOKENS_RATIO, HEADINGS, MARKDOWN, write_doc, write_part  # noqa: E402
from kernels import make_case, reference, time_cuda  # noqa: E402
from report import machine_line  # noqa: E402

# The training runs: (name, variant, the table's dtype (its sweep's launches), overrides added to the variant's).
TRAIN_RUNS = (("dense", "dense", None, []), ("memplus fp32", "memplus", "float32", []),
              ("memplus bf16", "memplus", "bfloat16", ["memory.value_dtype=bf16"]))


# ------------------------------------------------------------------ helpers
def commit() -> str:
    """The checkout's commit: $COMMIT (a device copy may carry no .git), else git's."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH.parent, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def time_cpu(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls, no warm-up: the dry run's timer (plumbing only)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


class Recorder:
    """The part's result, written to `path` (JSON) at every call.

        record = Recorder(path, {"part": "kernels"}); record("rows", row); record("copy", {...})
    "rows" and "results" append; any other key is set."""

    def __init__(self, path: Path | None, data: dict):
        self.path, self.data = path, data
        self.write()

    def __call__(self, key: str, value) -> None:
        if key in ("rows", "results"):
            self.data.setdefault(key, []).append(value)
        else:
            self.data[key] = value
        self.write()

    def write(self) -> None:
        if self.path:
            self.path.write_text(json.dumps(self.data, indent=1, default=str))


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def sweep_launches(path: Path | None, dtype: str | None) -> list[str]:
    """The sweep's fastest launches for a `dtype` table as config overrides
    (memory.triton_forward / triton_backward: recorded in the run's config.yaml);
    [] (the rule's or measured launches) without a sweep, a table, or timings."""
    from launch_sweep import config_overrides

    if path is None or dtype is None or not path.exists():
        return []
    result = json.loads(path.read_text()).get("sweeps", {}).get(dtype)
    return config_overrides(result) if result else []


# ------------------------------------------------------------------ kernels and sweep
def part_kernels(args, record) -> dict:
    import speed_kernels as sk

    timer = time_cpu if args.dry_run else time_cuda
    out = sk.part_kernels(args.dry_run, args.official, args.repeats or (1 if args.dry_run else 15), timer, record)
    data = record.data
    goals = {} if args.dry_run else sk.kernel_goals(data.get("rows", []), data.get("copy"),
                                                    torch.cuda.get_device_name())
    record("goals", goals)
    failures = out["failures"]
    line = "; ".join(failures[:3]) if failures else f"{len(data.get('rows', []))} timings" + (
        f"; notes: {'; '.join(out['notes'])}" if out["notes"] else "") + (
        f"; goals: {', '.join(f'{k} {v}' for k, v in goals.items())}" if goals else "")
    return {"ok": not failures, "line": line}


def part_sweep(args, record) -> dict:
    import speed_kernels as sk
    from launch_sweep import best_launches, dtype_of, sweep

    timer = time_cpu if args.dry_run else time_cuda
    shape = sk.DRY_SHAPE if args.dry_run else sk.GPU_SHAPE
    device = "cpu" if args.dry_run else "cuda"
    failures, sweeps = [], {}
    record("sweeps", sweeps)
    for name in ("float32", "bfloat16"):
        case = make_case(shape, dtype_of(name), device)
        ref = reference(case)
        sweeps[name] = {"dtype": name, "elem_bytes": case[0].element_size()}

        def keep(part, rows, name=name):
            sweeps[name][part] = rows
            record("sweeps", sweeps)

        sweeps[name] = sweep(case, ref, args.repeats or (1 if args.dry_run else 10), failures, timer, keep)
        record("sweeps", sweeps)
        record("failures", failures)
        del case, ref
        _free()
    best = [f"{what} {name} {tuple(la)}" for name, s in sweeps.items() for what, la in best_launches(s).items()]
    return {"ok": not failures, "line": "; ".join(failures[:3]) if failures else "fastest: " + ", ".join(best)}


# ------------------------------------------------------------------ train
def part_train(args, record) -> dict:
    """373M dense and Memory+ (fp32 and bf16 tables) in one mode; results appended to the JSON's."""
    import device_train as dt

    variants = dt._variants(args.dry_run)
    failures, launches = [], record.data.get("launches", {})
    with tempfile.TemporaryDirectory() as tmp:
        for label, variant, dtype, extra in TRAIN_RUNS:
            try:
                _free()
                if args.mode == "compiled":
                    torch._dynamo.reset()
                compiled = ["parallel.compile=true"] if args.mode == "compiled" else []
                launches[label] = sweep_launches(args.sweep, dtype)
                record("launches", launches)
                trainer = dt._trainer([*variants[variant], *extra, *launches[label], *compiled],
                                      f"{tmp}/{label.replace(' ', '-')}")
                start = time.perf_counter()
                trainer.train_step(read=False)  # compiles when compiled
                dt._sync(trainer.env.device)
                first = time.perf_counter() - start
                r = dt.timed_steps(trainer, 1 if args.dry_run else 3, 2 if args.dry_run else 10)
                r.update(model=label, mode=args.mode, first_step_s=first)
                record("results", r)
                print(f"PARTIAL speed_{'train' if args.mode == 'eager' else 'compiled'} {label}: {json.dumps(r)}",
                      flush=True)
                if not math.isfinite(r["loss"]):
                    failures.append(f"{label}: loss {r['loss']} is not finite")
                del trainer
            except Exception as err:  # noqa: BLE001 - recorded, the other runs go on
                traceback.print_exc()
                failures.append(f"{label} {args.mode}: {_first_line(err)}")
            finally:
                _free()
    ratios = train_ratios(record.data.get("results", []))
    record("ratios", ratios)
    mine = [r for r in record.data.get("results", []) if r["mode"] == args.mode]
    line = "; ".join(failures[:3]) if failures else ", ".join(f"{r['model']} {r['tokens_per_s']:,.0f} tok/s"
                                                               for r in mine)
    if ratios and not args.dry_run:
        line += "; Memory+/dense " + ", ".join(f"{k} {v:.2f}x (goal >= {GOAL_TOKENS_RATIO}: "
                                              f"{'met' if v >= GOAL_TOKENS_RATIO else 'not met'})"
                                              for k, v in ratios.items())
    return {"ok": not failures, "line": line}


def train_ratios(results) -> dict:
    """{"<memplus run> <mode>": its tokens/s over dense's in the same mode}."""
    by = {(r["model"], r["mode"]): r["tokens_per_s"] for r in results}
    return {f"{model} {mode}": tps / by[("dense", mode)] for (model, mode), tps in by.items()
            if model != "dense" and ("dense", mode) in by}


# ------------------------------------------------------------------ profile
def part_profile(args, record) -> dict:
    """One Memory+ step (fp32 table) and one dense step under torch.profiler, split by part."""
    import device_train as dt
    import speed_profile as sp
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() and not args.dry_run
    variants = dt._variants(args.dry_run)
    failures, steps = [], {}
    launches = {"memplus": sweep_launches(args.sweep, "float32"), "dense": []}
    record("launches", launches)
    record("steps", steps)
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("memplus", "dense"):
            try:
                _free()
                trainer = dt._trainer([*variants[variant], *launches[variant]], f"{tmp}/{variant}")
                for _ in range(2):
                    trainer.train_step(read=False)
                dt._sync(trainer.env.device)
                tables = {tuple(p.shape) for p in trainer.params[1]}
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                start = time.perf_counter()
                with profile(activities=activities, record_shapes=True) as prof:
                    trainer.train_step(read=False)
                    dt._sync(trainer.env.device)
                wall = time.perf_counter() - start
                events = prof.events()
                parts, ops = sp.split_device_time(events, tables, device=cuda)
                steps[variant] = {"wall_s": wall, "device_time": cuda, "table_shapes": sorted(tables),
                                  "parts_ms": parts, "shares": sp.shares(parts), "ops": list(ops.values()),
                                  "kernels": sp.kernel_table(events)}
                record("steps", steps)
                if parts["total"] <= 0:
                    failures.append(f"{variant}: no {'device' if cuda else 'CPU'} time recorded")
                del trainer, prof, events
            except Exception as err:  # noqa: BLE001 - recorded, the other step still runs
                traceback.print_exc()
                failures.append(f"{variant}: {_first_line(err)}")
    line = "; ".join(failures[:3]) if failures else "; ".join(
        f"{v} {s['parts_ms']['total']:.1f} ms: " + ", ".join(f"{k} {x:.0%}" for k, x in s["shares"].items() if x)
        for v, s in steps.items())
    return {"ok": not failures, "line": line}


# ------------------------------------------------------------------ main
PARTS = {"kernels": part_kernels, "sweep": part_sweep, "train": part_train, "profile": part_profile}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=[*PARTS, "doc"])
    parser.add_argument("out_dir", nargs="?", type=Path, help="doc: the run's folder of JSON files")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on CPU (kernels, sweep: TRITON_INTERPRET=1)")
    parser.add_argument("--official", type=Path, help="kernels: folder holding the official xformer_embeddingbag.py")
    parser.add_argument("--repeats", type=int, help="kernels, sweep: timed calls per figure")
    parser.add_argument("--mode", choices=("eager", "compiled"), default="eager", help="train: eager or compiled")
    parser.add_argument("--sweep", type=Path, help="train, profile: the sweep's JSON (its fastest launches are used)")
    parser.add_argument("--json", type=Path, help="write the figures here (after each row)")
    parser.add_argument("--doc", type=Path, help="markdown file whose GPU speed section gets this part")
    args = parser.parse_args(argv)
    if args.part == "doc":
        if args.out_dir is None or args.doc is None:
            parser.error("doc needs the run's folder and --doc")
        print(f"wrote {', '.join(write_doc(args.out_dir, args.doc)) or 'nothing'} into {args.doc}")
        return 0
    name = {"train": "speed_train" if args.mode == "eager" else "speed_compiled"}.get(args.part, f"speed_{args.part}")
    if not args.dry_run and not torch.cuda.is_available():
        print(f"RESULT {name} FAIL: no CUDA device (use --dry-run on CPU)", flush=True)
        return 1
    if args.dry_run and args.part in ("kernels", "sweep") and os.environ.get("TRITON_INTERPRET") != "1":
        print(f"RESULT {name} FAIL: a dry run of the kernels needs TRITON_INTERPRET=1 set at start", flush=True)
        return 1
    base = {"part": args.part, "commit": commit(), "machine": machine_line(), "dry_run": args.dry_run}
    if args.part == "train" and args.json and args.json.exists():  # the other mode's results are kept
        kept = json.loads(args.json.read_text())
        base["results"] = [r for r in kept.get("results", []) if r.get("mode") != args.mode]
    record = Recorder(args.json, base)
    try:
        result = PARTS[args.part](args, record)
    except Exception as err:  # noqa: BLE001 - any error fails the part, named
        traceback.print_exc()
        result = {"ok": False, "line": _first_line(err)}
    record("ok", result["ok"])
    record("line", result["line"])
    if args.doc:
        write_part(args.doc, HEADINGS[args.part], MARKDOWN[args.part](record.data))
    print(f"RESULT {name} {'ok' if result['ok'] else 'FAIL'}: {result['line']}", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
