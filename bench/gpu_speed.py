"""Issue #39's device run: the memory read's kernels and the 373M training step, measured side by side on one GPU.

    python bench/gpu_speed.py kernels --official .official --json OUT/k.json --doc OUT/benchmarks.md
    python bench/gpu_speed.py train --json OUT/t.json --doc OUT/benchmarks.md
    python bench/gpu_speed.py profile --json OUT/p.json --doc OUT/benchmarks.md
    python bench/gpu_speed.py kernels --dry-run    # tiny shapes on CPU (TRITON_INTERPRET=1): checks the plumbing

bench/device_check.sh runs the three as sections speed_kernels, speed_train
and speed_profile (SECTIONS="env speed"), about 7 minutes on one H200:

- kernels: at the paper's read (16,384 tokens x 4 heads x knn 32, 1M slots,
  v_dim 1024, bf16 table) every Triton algorithm of memory/fast/triton_bag.py
  ("segments", the default by construction; "by_slot" and "atomic", the
  first kernels), our torch path, F.embedding_bag and the official
  implementation's Triton embedding bag (facebookresearch/memory, copied by
  bench/official_kernel.sh into an ignored folder, passed as --official):
  each checked against a float32 F.embedding_bag, then timed forward,
  backward (table and weights' gradients from a given output gradient) and
  forward+backward (autograd); plus a sweep of the "segments" launches.
  FAIL: one of ours raises or is off the reference by more than 2e-2 of its
  max, or (on a GPU) --official is missing. The official kernel raising or
  being off is reported, not a FAIL of ours.
- train: the 373M model, bf16, 8 x 2,048 tokens, dense and Memory+ (1M
  slots, 3 layers sharing one pool), eager and compiled, tokens/s and MFU;
  Memory+ eager also with the first kernels (MEMLM_TRITON_BAG=by_slot).
  FAIL: a run raises or ends on a non-finite loss.
- profile: one eager Memory+ step under torch.profiler, device time by part
  (search, read forward, read backward, optimizer step, the rest).
  FAIL: the step raises or no time was recorded.

Every figure comes from this run; the speed goals of issue #39 are printed
as met / not met and never fail a section. Each part writes its JSON
(--json) and its part of the "## GPU speed (bench/gpu_speed.py)" section of
--doc (default: none written), the other parts kept. A dry run's figures
are CPU interpreter timings, labelled so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from kernels import block_sweep, checked, fwd_bytes, make_case, measure, reference, sweep_markdown, time_cuda  # noqa: E402
from report import machine_line, write_section  # noqa: E402

TITLE = "## GPU speed (bench/gpu_speed.py)"
# tokens, reads per token (heads x knn), slots, v_dim: the paper's read; the dry run's
# (v_dim a power of two: the official kernel needs one).
GPU_SHAPE = (16384, 128, 1 << 20, 1024)
DRY_SHAPE = (16, 8, 64, 64)
# Goals of issue #39 at GPU_SHAPE (reported, never a FAIL).
GOAL_FWD_GBS = 3000.0
GOAL_FWD_BWD_MS = 6.0
GOAL_TOKENS_RATIO = 0.9
ALGORITHM_NOTE = {"segments": "new: whole rows; blocked by-slot walk, weights' gradient fused",
                  "by_slot": "the first kernels, the default until #39",
                  "atomic": "the first forward, an atomic table gradient: not deterministic"}


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


def load_official(path: Path | None):
    """The official module (xformer_embeddingbag.py in `path`), or None."""
    if path is None:
        return None
    file = path / "xformer_embeddingbag.py" if path.is_dir() else path
    spec = importlib.util.spec_from_file_location("official_xformer_embeddingbag", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_cpu(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls, no warm-up: the dry run's timer (its
    figures only show that the plumbing runs)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def write_part(doc: Path, heading: str, body: str) -> None:
    """Replace the "### heading" part of TITLE's section in `doc`, keep the others."""
    text = doc.read_text() if doc.exists() else ""
    section = re.search(rf"^{re.escape(TITLE)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    parts = re.findall(r"^(### .*?)(?=^### |\Z)", section.group(1), re.S | re.M) if section else []
    kept = [p.strip() for p in parts if not p.startswith(f"### {heading}")]
    new = f"### {heading}\n\n{body.strip()}"
    order = ["Kernels", "Training step", "Profile"]
    blocks = sorted([*kept, new], key=lambda p: next((i for i, h in enumerate(order) if p.startswith(f"### {h}")),
                                                     len(order)))
    write_section(TITLE, "\n\n".join(blocks), doc)


# ------------------------------------------------------------------ kernels
def forward_variants(case, official) -> dict:
    """name -> callable returning the output (B, V)."""
    from memlm.memory.fast import triton_bag

    values, indices, weights, _ = (t.detach() for t in case)
    fns = {"segments": lambda: triton_bag.bag_forward(values, indices, weights, "segments"),
           "by_slot": lambda: triton_bag.bag_forward(values, indices, weights, "by_slot"),
           "F.embedding_bag": lambda: F.embedding_bag(indices, values, per_sample_weights=weights.to(values.dtype),
                                                      mode="sum")}
    if official is not None:
        fns["official"] = lambda: official.embedding_bag_triton(indices, values, weights)
    return fns


def backward_variants(case, official) -> dict:
    """name -> callable returning (table gradient, weights' gradient) from the output gradient."""
    from memlm.memory.fast import ops, triton_bag

    values, indices, weights, grad_out = (t.detach() for t in case)
    fns = {}
    for algorithm in triton_bag.ALGORITHMS:
        fns[algorithm] = lambda a=algorithm: triton_bag.gradients(values, indices, weights, grad_out, algorithm=a)
    fns["segments sparse"] = lambda: triton_bag.gradients(values, indices, weights, grad_out, sparse=True)
    fns["torch"] = lambda: ops._bag_gradients(grad_out, values, indices, weights, False, "torch", True, True)
    if official is not None:
        fns["official"] = lambda: official.embedding_bag_bw_rev_indices(indices, values, weights, grad_out)
        fns["official atomics"] = lambda: official.embedding_bag_bw2(indices, values, weights, grad_out, True)
    return fns


def train_variants(case, official) -> dict:
    """name -> callable running forward + backward through autograd, returning (out, table grad, weights' grad)."""
    from memlm.memory.fast import ops, triton_bag

    values, indices, weights, grad_out = case

    def run(read):
        out = read()
        return (out, *torch.autograd.grad(out, (values, weights), grad_out))

    fns = {a: (lambda a=a: run(lambda: triton_bag.embedding_bag_triton(values, indices, weights, algorithm=a)))
           for a in triton_bag.ALGORITHMS}
    fns["torch"] = lambda: run(lambda: ops.embedding_bag(values, indices, weights, kernel="torch"))
    if official is not None:
        fns["official"] = lambda: run(lambda: official.xformers_embedding_bag(indices, values, weights))
    return fns


def part_kernels(dry: bool, official_dir: Path | None, repeats: int) -> dict:
    device = "cpu" if dry else "cuda"
    shape = DRY_SHAPE if dry else GPU_SHAPE
    timer = time_cpu if dry else time_cuda
    failures, notes = [], []
    official = checked("official import", notes, lambda: load_official(official_dir)) if official_dir else None
    if official_dir is None:
        (notes if dry else failures).append("the official kernel was not given (--official DIR: "
                                            "bench/official_kernel.sh makes it)")
    case = make_case(shape, torch.bfloat16, device)
    ref = reference(case)
    nbytes = fwd_bytes(shape, torch.bfloat16)
    rows = []
    passes = (("fwd", forward_variants, (0,)), ("bwd", backward_variants, (1, 2)),
              ("fwd+bwd", train_variants, (0, 1, 2)))
    for pass_, make, which in passes:
        for name, fn in make(case, official).items():
            ours = not (name.startswith("official") or name == "F.embedding_bag")
            sec = measure(f"{pass_} {name}", fn, ref, which, timer, repeats, failures, notes, ours)
            if sec is None:
                continue
            rows.append(dict(name=name, pass_=pass_, ms=sec * 1e3, gbs=nbytes / sec / 1e9 if pass_ == "fwd" else None))
            print(f"{pass_:7s} {name:18s} {sec * 1e3:9.3f} ms" + (f"  {nbytes / sec / 1e9:6.0f} GB/s"
                                                                if pass_ == "fwd" else ""), flush=True)
    sweep = block_sweep(case, ref, repeats, failures, timer)
    goals = kernel_goals(rows) if not dry else {}
    return {"ok": not failures, "shape": shape, "rows": rows, "sweep": sweep, "failures": failures,
            "notes": notes, "goals": goals, "official": str(official_dir) if official_dir else None,
            "line": "; ".join(failures[:3]) if failures else f"{len(rows)} timings" + (
                f"; official: {'; '.join(notes)}" if notes else "") + (
                f"; goals: {', '.join(f'{k} {v}' for k, v in goals.items())}" if goals else "")}


def kernel_goals(rows) -> dict:
    """Issue #39's kernel goals: met / not met (or not measured)."""
    ms = {(r["name"], r["pass_"]): r["ms"] for r in rows}
    gbs = {r["name"]: r["gbs"] for r in rows if r["gbs"]}
    goals = {}
    if "segments" in gbs:
        goals["forward >= 3.0 TB/s"] = f"{'met' if gbs['segments'] >= GOAL_FWD_GBS else 'not met'} " \
                                       f"({gbs['segments'] / 1e3:.2f} TB/s)"
    if ("segments", "fwd+bwd") in ms:
        t = ms[("segments", "fwd+bwd")]
        goals["fwd+bwd <= 6 ms"] = f"{'met' if t <= GOAL_FWD_BWD_MS else 'not met'} ({t:.2f} ms)"
    for pass_ in ("fwd", "bwd", "fwd+bwd"):
        if ("official", pass_) in ms and ("segments", pass_) in ms:
            ours, theirs = ms[("segments", pass_)], ms[("official", pass_)]
            goals[f"{pass_} vs official"] = f"{'met' if ours <= theirs else 'not met'} ({theirs / ours:.2f}x)"
    return goals


def kernels_markdown(result: dict, dry: bool) -> str:
    tokens, reads, slots, v_dim = result["shape"]
    official = {r["pass_"]: r["ms"] for r in result["rows"] if r["name"] == "official"}
    lines = [("**DRY RUN on CPU (Triton interpreter): plumbing only, not speeds.**\n\n" if dry else "")
             + f"{machine_line()} Commit {commit()}.", "",
             f"{tokens:,} tokens x {reads} reads, {slots:,} slots, v_dim {v_dim}, bf16 table, fp32 weights; "
             f"median of {'perf_counter' if dry else 'CUDA-event'} timings; every variant checked against a "
             "float32 F.embedding_bag first. "
             "bwd: both gradients from a given output gradient (sort included); fwd+bwd: through autograd.", "",
             "| variant | pass | time | effective bandwidth | official / this |", "|---|---|---:|---:|---:|"]
    for r in result["rows"]:
        name = r["name"] + (f" ({ALGORITHM_NOTE[r['name']]})" if r["name"] in ALGORITHM_NOTE else "")
        ratio = f"{official[r['pass_']] / r['ms']:.2f}x" if r["pass_"] in official else "-"
        bandwidth = f"{r['gbs']:.0f} GB/s" if r["gbs"] else "-"
        lines.append(f"| {name} | {r['pass_']} | {r['ms']:.3f} ms | {bandwidth} | {ratio} |")
    lines += sweep_markdown(result["sweep"])
    notes = [f"- {k}: {v}." for k, v in result["goals"].items()] + [f"- Not measured: {n}."
                                                                     for n in result["notes"]]
    lines += [""] + notes if notes else []
    return "\n".join(lines)


# ------------------------------------------------------------------ train
def part_train(dry: bool) -> dict:
    """373M dense and Memory+, eager and compiled (and Memory+ eager on the first kernels)."""
    import device_train as dt

    from memlm.memory.fast import triton_bag

    variants = dt._variants(dry)
    runs = [("dense", "eager", None), ("memplus", "eager", None), ("memplus", "eager", "by_slot"),
            ("dense", "compiled", None), ("memplus", "compiled", None)]
    if dry:  # the interpreter is not used by the train step on CPU: the first kernels are the same run there
        runs.remove(("memplus", "eager", "by_slot"))
    results, failures = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for variant, mode, algorithm in runs:
            label = f"{variant} {mode}" + (f" {algorithm}" if algorithm else "")
            if algorithm:
                os.environ[triton_bag.ALGORITHM_ENV] = algorithm
            extra = ["parallel.compile=true"] if mode == "compiled" else []
            try:
                if mode == "compiled":
                    torch._dynamo.reset()
                trainer = dt._trainer([*variants[variant], *extra], f"{tmp}/{label.replace(' ', '-')}")
                start = time.perf_counter()
                trainer.train_step(read=False)  # compiles when compiled
                dt._sync(trainer.env.device)
                first = time.perf_counter() - start
                r = dt.timed_steps(trainer, 1 if dry else 3, 2 if dry else 10)
                r.update(variant=variant, mode=mode, kernels=algorithm or "segments", first_step_s=first)
                results.append(r)
                print(f"PARTIAL speed_train {label}: {json.dumps(r)}", flush=True)
                if not math.isfinite(r["loss"]):
                    failures.append(f"{label}: loss {r['loss']} is not finite")
                del trainer
            except Exception as err:  # noqa: BLE001 - recorded, the other runs go on
                traceback.print_exc()
                failures.append(f"{label}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
            finally:
                os.environ.pop(triton_bag.ALGORITHM_ENV, None)
                dt._empty_cache()
    ratios = train_ratios(results)
    line = "; ".join(failures[:3]) if failures else ", ".join(
        f"{r['variant']} {r['mode']}{'' if r['kernels'] == 'segments' else ' ' + r['kernels']} "
        f"{r['tokens_per_s']:,.0f} tok/s" for r in results)
    if ratios and not dry:
        line += "; Memory+/dense " + ", ".join(f"{k} {v:.2f}x (goal >= {GOAL_TOKENS_RATIO}: "
                                              f"{'met' if v >= GOAL_TOKENS_RATIO else 'not met'})"
                                              for k, v in ratios.items())
    return {"ok": not failures, "results": results, "ratios": ratios, "failures": failures, "line": line}


def train_ratios(results) -> dict:
    """Memory+ tokens/s over dense's, per mode (new kernels)."""
    by = {(r["variant"], r["mode"], r["kernels"]): r["tokens_per_s"] for r in results}
    return {mode: by[("memplus", mode, "segments")] / by[("dense", mode, "segments")]
            for mode in ("eager", "compiled")
            if ("memplus", mode, "segments") in by and ("dense", mode, "segments") in by}


def train_markdown(result: dict, dry: bool) -> str:
    import device_train as dt

    variants = dt._variants(dry)
    model, memplus = " ".join(variants["dense"]), " ".join(variants["memplus"][len(variants["dense"]):])
    lines = [("**DRY RUN on CPU (tiny models): plumbing only, not speeds.**\n\n" if dry else "")
             + f"{machine_line()} Commit {commit()}.", "",
             f"`{model}`, random tokens, the real Trainer; Memory+ adds `{memplus}`"
             + ("" if dry else " (1M slots, 3 layers sharing one pool)")
             + "; mean step time over the timed steps after warm-up; compiled = `parallel.compile=true`, its "
             "first step includes the compilation.", "",
             "| model | read kernels | mode | step | tokens/s | TFLOP/s | MFU | first step |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in result["results"]:
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        lines.append(f"| {r['variant']} | {r['kernels'] if r['variant'] == 'memplus' else '-'} | {r['mode']} | "
                     f"{r['step_s'] * 1e3:.1f} ms | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {mfu} | "
                     f"{r['first_step_s']:.1f} s |")
    lines += ["", *(f"- Memory+ / dense tokens/s, {k}: {v:.2f}x (goal >= {GOAL_TOKENS_RATIO})."
                    for k, v in result["ratios"].items())]
    return "\n".join(lines)


# ------------------------------------------------------------------ profile
# Device time of these ops (outermost match only) is one part each; the rest is "the rest".
PROFILE_PARTS = (("search forward", ("memlm::product_key_search", "memlm::product_key_ranks",
                                     "memlm::exact_subkey_scores")),
                 ("search backward", ("memlm::product_key_search_backward",)),
                 ("read forward", ("memlm::embedding_bag",)),
                 ("read backward", ("memlm::embedding_bag_backward",)),
                 ("optimizer step (all parameters, the value table's included)", ("Optimizer.step#",)))


def _part_of(name: str) -> str | None:
    for part, prefixes in PROFILE_PARTS:
        if any(name == p or (p.endswith("#") and name.startswith(p)) for p in prefixes):
            return part
    return None


def profile_breakdown(events, device_time: bool) -> dict:
    """{part: milliseconds} from a profiler's FunctionEvents: each outermost event
    of a part counts with its children's time; "total" is the sum of self times."""
    def own(e):
        return (e.self_device_time_total if device_time else e.self_cpu_time_total) / 1e3

    def inclusive(e):
        return (e.device_time_total if device_time else e.cpu_time_total) / 1e3

    parts = {part: 0.0 for part, _ in PROFILE_PARTS}
    total = 0.0
    for e in events:
        total += own(e)
        part = _part_of(e.name)
        if part is None:
            continue
        parent, nested = e.cpu_parent, False
        while parent is not None:
            if _part_of(parent.name) is not None:
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            parts[part] += inclusive(e)
    parts["the rest"] = max(0.0, total - sum(parts.values()))
    parts["total"] = total
    return parts


def part_profile(dry: bool) -> dict:
    import device_train as dt
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() and not dry
    with tempfile.TemporaryDirectory() as tmp:
        trainer = dt._trainer(dt._variants(dry)["memplus"], f"{tmp}/profile")
        for _ in range(2):
            trainer.train_step(read=False)
        dt._sync(trainer.env.device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            trainer.train_step(read=False)
            dt._sync(trainer.env.device)
        wall = time.perf_counter() - start
        parts = profile_breakdown(prof.events(), cuda)
        top = sorted(prof.key_averages(), key=lambda a: -(a.self_device_time_total if cuda else a.self_cpu_time_total))
        kernels = [dict(name=a.key[:120], ms=(a.self_device_time_total if cuda else a.self_cpu_time_total) / 1e3,
                        calls=a.count) for a in top[:15]]
    ok = parts["total"] > 0
    line = (f"step {wall * 1e3:.0f} ms wall, {parts['total']:.1f} ms {'device' if cuda else 'CPU'} time: "
            + ", ".join(f"{k} {v / parts['total']:.0%}" for k, v in parts.items() if k != "total")
            if ok else "no time recorded")
    return {"ok": ok, "wall_s": wall, "parts_ms": parts, "top": kernels, "device_time": cuda, "line": line}


def profile_markdown(result: dict, dry: bool) -> str:
    parts = result["parts_ms"]
    kind = "device" if result["device_time"] else "CPU"
    lines = [("**DRY RUN on CPU (tiny model): plumbing only, not speeds.**\n\n" if dry else "")
             + f"{machine_line()} Commit {commit()}.", "",
             f"One eager Memory+ step (the training part's model) under torch.profiler after 2 warm-up steps: "
             f"{result['wall_s'] * 1e3:.0f} ms wall, {parts['total']:.1f} ms of {kind} time. A part is the "
             f"{kind} time of its ops with everything they launch.", "",
             "| part | time | share |", "|---|---:|---:|"]
    for k, v in parts.items():
        if k != "total":
            lines.append(f"| {k} | {v:.2f} ms | {v / max(parts['total'], 1e-9):.1%} |")
    lines += ["", "Largest by own time:", "", "| op or kernel | time | calls |", "|---|---:|---:|"]
    lines += [f"| `{t['name']}` | {t['ms']:.2f} ms | {t['calls']} |" for t in result["top"][:10]]
    return "\n".join(lines)


# ------------------------------------------------------------------ main
PARTS = {"kernels": ("Kernels", kernels_markdown), "train": ("Training step", train_markdown),
         "profile": ("Profile", profile_markdown)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=sorted(PARTS))
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (kernels: TRITON_INTERPRET=1)")
    parser.add_argument("--official", type=Path, help="kernels: folder holding the official xformer_embeddingbag.py")
    parser.add_argument("--repeats", type=int, help="kernels: timed calls per figure (default 20; dry run 1)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--doc", type=Path, help="markdown file whose GPU speed section gets this part")
    args = parser.parse_args(argv)
    name = f"speed_{args.part}"
    if not args.dry_run and not torch.cuda.is_available():
        print(f"RESULT {name} FAIL: no CUDA device (use --dry-run on CPU)", flush=True)
        return 1
    if args.dry_run and args.part == "kernels" and os.environ.get("TRITON_INTERPRET") != "1":
        print(f"RESULT {name} FAIL: a dry run of the kernels needs TRITON_INTERPRET=1 set at start", flush=True)
        return 1
    try:
        if args.part == "kernels":
            result = part_kernels(args.dry_run, args.official, args.repeats or (1 if args.dry_run else 20))
        elif args.part == "train":
            result = part_train(args.dry_run)
        else:
            result = part_profile(args.dry_run)
    except Exception as err:  # noqa: BLE001 - any error fails the part, named
        traceback.print_exc()
        result = {"ok": False, "line": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    result.update(commit=commit(), machine=machine_line(), dry_run=args.dry_run)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    if args.doc and any(key in result for key in ("rows", "results", "parts_ms")):  # figures to show
        heading, markdown = PARTS[args.part]
        write_part(args.doc, heading, markdown(result, args.dry_run))
    print(f"RESULT {name} {'ok' if result['ok'] else 'FAIL'}: {result['line']}", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
