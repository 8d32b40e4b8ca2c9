"""Benchmark and check: the memory read (memory.fast.ops.embedding_bag) against F.embedding_bag.

    python bench/kernels.py [--quick] [--gpu-only] [--no-sweep] [--json PATH] [--doc PATH]

Every kernel is first checked, then timed: its output, table gradient and
weight gradient against a float32 F.embedding_bag on the same inputs (max
error / max |reference| within RESULT_TOL of the table's dtype). A kernel
that raises or is off is not timed; the run goes on with the others and
ends with `RESULT kernel_bench FAIL: <what, why>` and exit status 1, and
docs/benchmarks.md is then left as it was. Otherwise `RESULT kernel_bench
ok: ...` and exit status 0.

CPU rows (always, unless --gpu-only): our CPU path (kernel=torch) vs
F.embedding_bag at scaled-down shapes, forward and forward+backward (table
and weight gradients), dense and sparse table gradients; goal: no slower.
GPU rows (only when CUDA is present): the Triton kernels vs F.embedding_bag
at the paper's shapes (16K tokens, 4 heads x 32 reads, 1M slots, v_dim 1024,
bf16), plus the launch sweep of bench/launch_sweep.py.

Effective bandwidth = (bytes of the table rows read + bytes of the output
written) / forward time: the traffic a read cannot avoid. Every figure is
measured in this run; ratios compare runs interleaved in the same process.
The "## Kernels (bench/kernels.py)" section of docs/benchmarks.md is
rewritten (a passing run only); a part not measured in this run (CPU or GPU)
is kept from the existing section.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_doc import TITLE, cpu_markdown, gpu_markdown, kept_part  # noqa: E402
from report import DOC, machine_line, write_section  # noqa: E402

from memlm.memory.fast import ops  # noqa: E402

# tokens, reads per token (heads x knn), slots, v_dim
CPU_SHAPE = (2048, 128, 65536, 256)
GPU_SHAPE = (16384, 128, 1 << 20, 1024)
# "triton": memory/fast/triton_bag.py's read; "triton-by_slot", "triton-atomic": the first kernels
# (bench/bag_variants.py).
GPU_KERNELS = ("triton", "triton-by_slot", "triton-atomic", "torch", "F.embedding_bag")
FIRST_KERNELS = {"triton-by_slot": "embedding_bag_by_slot", "triton-atomic": "embedding_bag_atomic"}
# Largest passing max |kernel - float32 reference| / max |reference|, per table
# dtype: float32 accumulation-order noise, and bf16's 8-bit significand (output
# and table gradient rounded to bf16: ~0.4% of a value, a few of them summed).
RESULT_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}



def make_case(shape, dtype, device, seed=0):
    tokens, reads, slots, v_dim = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    values = (torch.randn(slots, v_dim, device=device, generator=gen) * v_dim**-0.5).to(dtype)
    indices = torch.randint(0, slots, (tokens, reads), device=device, generator=gen)
    weights = torch.softmax(torch.randn(tokens, reads, device=device, generator=gen), -1)
    grad_out = torch.randn(tokens, v_dim, device=device, generator=gen).to(dtype)
    return values.requires_grad_(), indices, weights.requires_grad_(), grad_out


def read(name, values, indices, weights, sparse=False):
    """The read (B, v_dim) by kernel `name`: "F.embedding_bag", one of the
    first kernels ("triton-by_slot", "triton-atomic": dense gradients only), or
    a memory.kernel value of ops.embedding_bag ("triton", "torch", ...)."""
    if name == "F.embedding_bag":
        return F.embedding_bag(indices, values, per_sample_weights=weights.to(values.dtype), mode="sum",
                               sparse=sparse)
    if name in FIRST_KERNELS:
        import bag_variants

        return getattr(bag_variants, FIRST_KERNELS[name])(values, indices, weights)
    return ops.embedding_bag(values, indices, weights, sparse=sparse, kernel=name)


def runner(name, case, sparse=False):
    """A callable doing forward (train=False) or forward+backward (train=True)."""
    values, indices, weights, grad_out = case

    def run(train):
        with torch.set_grad_enabled(train):
            out = read(name, values, indices, weights, sparse)
            if train:
                torch.autograd.grad(out, (values, weights), grad_out)
    return run


def _dense(t: torch.Tensor) -> torch.Tensor:
    return (t.to_dense() if t.is_sparse else t).float()


def results_of(name, case, sparse=False) -> tuple[torch.Tensor, ...]:
    """Output (B, v_dim), table gradient (N, v_dim) and weight gradient (B, K)
    of one forward+backward, dense float32."""
    values, indices, weights, grad_out = case
    out = read(name, values, indices, weights, sparse)
    grad_values, grad_weights = torch.autograd.grad(out, (values, weights), grad_out)
    return _dense(out.detach()), _dense(grad_values), _dense(grad_weights)


def reference(case) -> tuple[torch.Tensor, ...]:
    """results_of in float32 throughout (F.embedding_bag on the upcast table)."""
    values, indices, weights, grad_out = case
    case32 = (values.detach().float().requires_grad_(), indices, weights.detach().float().requires_grad_(),
              grad_out.float())
    return results_of("F.embedding_bag", case32)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (NaN stays NaN: `not err <= tol` catches it)."""
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def check(name, case, ref, sparse=False) -> str | None:
    """None when kernel `name` matches the reference `ref` within RESULT_TOL,
    else what is off (raises what the kernel raises)."""
    tol = RESULT_TOL[case[0].dtype]
    off = []
    for what, got, want in zip(("output", "table grad", "weight grad"), results_of(name, case, sparse), ref):
        if got.shape != want.shape:
            off.append(f"{what} shape {tuple(got.shape)} != {tuple(want.shape)}")
            continue
        err = relative_error(got, want)
        if not err <= tol:  # also NaN
            off.append(f"{what} off by {err:.2e} of its max (limit {tol:.0e})")
    return "; ".join(off) or None


def verified(label: str, name, case, ref, failures: list[str], sparse=False) -> bool:
    """Whether kernel `name` runs and matches `ref`; else why goes to `failures`."""
    off = checked(f"{label} {name}", failures, lambda: check(name, case, ref, sparse) or "")
    if off:
        failures.append(f"{label} {name}: {off}")
        print(f"{label} {name} WRONG: {off}", flush=True)
    return off == ""


def checked(label: str, failures: list[str], fn):
    """fn() or None; an exception is recorded in `failures` as label: error."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - recorded, reported, and the run fails
        failures.append(f"{label} raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        print(f"{label} FAILED: {exc!r}", flush=True)
        return None


def time_cpu(fns: dict, repeats: int) -> dict:
    """Fastest of `repeats` per callable, the callables interleaved so that a
    burst of load from other jobs hits all of them alike."""
    best = {k: float("inf") for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for rep in range(repeats):
        # Alternate the order too: the first of a pair often finds colder caches.
        for k, fn in (fns.items() if rep % 2 == 0 else reversed(fns.items())):
            start = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - start)
    return best


def time_cuda(fn, repeats: int) -> float:
    """Median seconds per call over CUDA events, after warm-up (compilation)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def fwd_bytes(shape, dtype) -> int:
    tokens, reads, _, v_dim = shape
    size = torch.empty((), dtype=dtype).element_size()
    return tokens * reads * v_dim * size + tokens * v_dim * size


def bench_cpu(shape, repeats: int, failures: list[str]) -> list[dict]:
    """Our CPU path vs F.embedding_bag, each checked against the float32
    reference first; what fails goes to `failures` and is not timed."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        case = make_case(shape, dtype, "cpu")
        ref_results = reference(case)
        for sparse in (False, True):
            label = f"cpu {str(dtype).split('.')[-1]} {'sparse' if sparse else 'dense'}"
            if not all([verified(label, name, case, ref_results, failures, sparse)
                        for name in ("torch", "F.embedding_bag")]):
                continue
            ours, ref = runner("torch", case, sparse), runner("F.embedding_bag", case, sparse)
            fns = {("ours", False): lambda o=ours: o(False), ("ref", False): lambda r=ref: r(False),
                   ("ours", True): lambda o=ours: o(True), ("ref", True): lambda r=ref: r(True)}
            if sparse:  # the forward does not depend on the gradient format: measured once
                fns = {k: v for k, v in fns.items() if k[1]}
            best = time_cpu(fns, repeats)
            for train in (False, True):
                if (("ours", train)) not in best:
                    continue
                o, r = best[("ours", train)], best[("ref", train)]
                rows.append(dict(device="cpu", dtype=str(dtype).split(".")[-1], sparse=sparse,
                                 pass_="fwd+bwd" if train else "fwd", ours_ms=o * 1e3, ref_ms=r * 1e3,
                                 ours_gbs=fwd_bytes(shape, dtype) / o / 1e9 if not train else None,
                                 ref_gbs=fwd_bytes(shape, dtype) / r / 1e9 if not train else None,
                                 speedup=r / o))
                print(f"cpu {rows[-1]['dtype']:8s} {'sparse' if sparse else 'dense ':6s} {rows[-1]['pass_']:7s} "
                      f"ours {o * 1e3:8.1f} ms  F.embedding_bag {r * 1e3:8.1f} ms  F/ours {r / o:.2f}x",
                      flush=True)
    return rows


def trains_with_bf16_weights(device) -> bool:
    """Whether F.embedding_bag on `device` has the backward of bf16 per-sample
    weights; CUDA's has none (torch 2.11: NotImplementedError), so there the
    baseline is timed forward only."""
    values = torch.zeros(2, 2, dtype=torch.bfloat16, device=device)
    weights = torch.ones(1, 1, dtype=torch.bfloat16, device=device, requires_grad=True)
    out = F.embedding_bag(torch.zeros(1, 1, dtype=torch.long, device=device), values,
                          per_sample_weights=weights, mode="sum")
    try:
        torch.autograd.grad(out.sum(), weights)
    except NotImplementedError:
        return False
    return True


def forward_off(name, case, ref_out) -> str | None:
    """check() of the output alone (a kernel timed forward only)."""
    values, indices, weights, _ = case
    with torch.no_grad():
        err = relative_error(_dense(read(name, values, indices, weights)), ref_out)
    tol = RESULT_TOL[values.dtype]
    return None if err <= tol else f"output off by {err:.2e} of its max (limit {tol:.0e})"


def bench_gpu(shape, repeats: int, sweep: bool, failures: list[str], device: str = "cuda",
              kernels: tuple[str, ...] = GPU_KERNELS, timer=time_cuda) -> tuple[list[dict], list[dict]]:
    """The kernels on a bf16 table at `shape`, each checked against the
    float32 reference, then timed with `timer(fn, repeats)` (CUDA events);
    what raises or is off goes to `failures` (the other rows still run)."""
    rows, sweeps = [], {}
    case = make_case(shape, torch.bfloat16, device)
    nbytes = fwd_bytes(shape, torch.bfloat16)
    ref_results = reference(case)
    baseline_trains = trains_with_bf16_weights(device)
    for name in kernels:
        passes = (False, True)
        if name == "F.embedding_bag" and not baseline_trains:
            passes = (False,)  # no bf16 weights backward in torch: its forward is the baseline
            print(f"{device} {name}: no bf16 per-sample-weights backward in torch {torch.__version__}; "
                  "forward only", flush=True)
            off = checked(f"{device} {name}", failures, lambda n=name: forward_off(n, case, ref_results[0]) or "")
            if off:
                failures.append(f"{device} {name}: {off}")
                continue
        elif not verified(device, name, case, ref_results, failures):
            continue
        run = runner(name, case)
        for train in passes:
            if train is False and name in ("triton-atomic", "torch") and rows:
                continue  # same forward as "triton-by_slot" / F.embedding_bag
            label = f"{device} {name} {'fwd+bwd' if train else 'fwd'}"
            sec = checked(label, failures, lambda r=run, t=train: timer(lambda: r(t), repeats))
            if sec is None:
                continue
            rows.append(dict(device=device, dtype="bfloat16", sparse=False, name=name,
                             pass_="fwd+bwd" if train else "fwd", ms=sec * 1e3,
                             gbs=nbytes / sec / 1e9 if not train else None))
            print(f"{device} {name:16s} {rows[-1]['pass_']:7s} {sec * 1e3:8.3f} ms"
                  + (f"  {nbytes / sec / 1e9:7.0f} GB/s" if not train else ""), flush=True)
        torch.cuda.empty_cache()
    if sweep:
        from launch_sweep import sweep as launch_sweep

        sweeps = launch_sweep(case, ref_results, repeats, failures, timer)
    return rows, sweeps


def off_by(results, ref, which: tuple[int, ...], dtype=torch.bfloat16) -> str | None:
    """What of `results` is off the float32 reference (ref[i] for i in which), or None."""
    tol = RESULT_TOL[dtype]
    off = []
    for got, i in zip(results, which):
        what = ("output", "table grad", "weight grad")[i]
        if got is None or tuple(got.shape) != tuple(ref[i].shape):
            off.append(f"{what} shape {None if got is None else tuple(got.shape)}")
            continue
        err = relative_error(_dense(got), ref[i])
        if not err <= tol:
            off.append(f"{what} off by {err:.2e} of its max (limit {tol:.0e})")
    return "; ".join(off) or None


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(label: str, fn, ref, which, timer, repeats, failures, notes, ours: bool, dtype=torch.bfloat16):
    """Check fn()'s results against ref (within RESULT_TOL[dtype], the table's
    dtype), then time it: seconds, or None (why goes to failures for ours, to
    notes for the others)."""
    sink = failures if ours else notes
    off = checked(label, sink, lambda: off_by(fn() if len(which) > 1 else (fn(),), ref, which, dtype) or "")
    if off is None:
        return None
    if off:
        sink.append(f"{label}: {off}")
        print(f"{label} WRONG: {off}", flush=True)
        return None
    sec = checked(label, sink, lambda: timer(fn, repeats))
    _sync()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return sec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, smaller CPU shape")
    parser.add_argument("--gpu-only", action="store_true", help="skip the CPU rows (needs a CUDA device)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the GPU block-size sweep")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the CPU rows (default 1: stable ratios on shared cores)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--doc", type=Path, default=DOC, help="markdown file to update (default docs/benchmarks.md)")
    args = parser.parse_args(argv)
    cpu_shape = (512, 128, 16384, 128) if args.quick else CPU_SHAPE
    results = {"machine": machine_line()}
    failures: list[str] = []
    cpu_md = gpu_md = ""
    if args.gpu_only and not torch.cuda.is_available():
        failures.append("--gpu-only without a CUDA device: nothing to check")
    if not args.gpu_only:
        torch.set_num_threads(args.threads)
        rows = bench_cpu(cpu_shape, 2 if args.quick else 5, failures)
        results["cpu"] = dict(shape=cpu_shape, rows=rows)
        if rows:
            cpu_md = cpu_markdown(rows, cpu_shape, torch.get_num_threads())
            worst = min(r["speedup"] for r in rows if r["pass_"] == "fwd+bwd")
            print(f"CPU forward+backward: ours vs F.embedding_bag, slowest case F/ours = {worst:.2f}x "
                  f"(goal >= 1: {'met' if worst >= 1 else 'not met'})")
    if torch.cuda.is_available():
        gpu_rows, sweeps = bench_gpu(GPU_SHAPE, 5 if args.quick else 20, not args.no_sweep, failures)
        results["gpu"] = dict(shape=GPU_SHAPE, rows=gpu_rows, sweep=sweeps)
        gpu_md = gpu_markdown(gpu_rows, sweeps, GPU_SHAPE) if gpu_rows else ""
    results["failures"] = failures
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if failures:
        print(f"not writing {args.doc}: the run failed", flush=True)
        print(f"RESULT kernel_bench FAIL: {len(failures)} failure(s): " + "; ".join(failures[:3]), flush=True)
        return 1
    cpu_md = cpu_md or kept_part(args.doc, "CPU")
    gpu_md = gpu_md or kept_part(args.doc, "GPU") or "### GPU\n\nNot measured yet: run bench/device_check.sh on a GPU."
    write_section(TITLE, cpu_md + "\n\n" + gpu_md, args.doc)
    print(f"wrote {TITLE!r} to {args.doc}")
    parts = [f"{len(results.get(k, {}).get('rows', []))} {k} rows" for k in ("cpu", "gpu") if k in results]
    print(f"RESULT kernel_bench ok: every kernel matches the float32 reference; {', '.join(parts)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
