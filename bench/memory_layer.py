"""Benchmark: cost of a MemoryPlus layer against a dense SwiGLU FFN, on this machine.

    python bench/memory_layer.py            # full run (~2-3 minutes on 2 cores)
    python bench/memory_layer.py --quick    # smaller sizes, a smoke run

Measured in one run, all at dim 512 on 2048 tokens, for each layer both
forward + backward alone (the issue's figure: the goal is judged on it) and
one full training step (forward, backward, optimizer step):
1. a dense SwiGLU FFN (hidden 1536, Llama's rule) with torch AdamW: the baseline;
2. MemoryPlus (4 heads x knn 32, k_dim 512) at 16K, 64K, 256K and 1M slots,
   - reference: torch EmbeddingBag's own backward + torch AdamW defaults,
   - dense path (memlm default): dense table gradient + fused torch AdamW
     over the whole table,
   - sparse path: `sparse_updates` + SparseRowAdamW on the rows read;
3. product-key lookup against flat scoring of all 1M slots (one head, forward
   only, time per token).
Prints the table and writes it into docs/benchmarks.md under
"## Memory layer (bench/memory_layer.py)" (other sections are kept).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import DOC, cpu_model, write_section  # noqa: E402

from memlm.memory import MemoryPlus, SparseRowAdamW, value_parameters
from memlm.memory.fast.search import product_key_topk, subkey_scores
from memlm.model.ffn import SwiGLU

DIM, TOKENS, HEADS, KNN, K_DIM = 512, 2048, 4, 32, 512
SECTION = "## Memory layer (bench/memory_layer.py)"
PATHS = ("reference", "dense", "sparse")


def time_step(step, repeats: int) -> float:
    """Fastest of `repeats` timed calls of `step()`, after one warm-up call.
    The minimum, not the mean: other jobs on a shared CPU only ever add time."""
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def time_both(fwd_bwd, step, repeats: int) -> tuple[float, float]:
    """Fastest of `repeats` timed calls of each of fwd_bwd() and step(), in
    turn (one of each per round), so that drifting load from other jobs
    affects both alike; one warm-up call of each first."""
    fwd_bwd(), step()
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, fn in enumerate((fwd_bwd, step)):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def training_step(module, optimizers, x, grad_out):
    """One step; without optimizers, forward + backward only (gradients
    dropped first, as zero_grad(set_to_none=True) does in a step)."""

    def step():
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        if not optimizers:
            for p in module.parameters():
                p.grad = None
        x.grad = None
        module(x).backward(grad_out)
        for opt in optimizers:
            opt.step()

    return step


def bench_dense_ffn(x, grad_out, repeats) -> tuple[float, float]:
    """Seconds of forward + backward, and of a training step, of the dense FFN."""
    ffn = SwiGLU(DIM, 1536)
    ffn.init_weights(0.02, 0.02)
    opt = torch.optim.AdamW(ffn.parameters(), lr=1e-4, fused=True)
    return time_both(training_step(ffn, [], x, grad_out), training_step(ffn, [opt], x, grad_out), repeats)


def _native_reader(pool, indices, weights, sparse, kernel, launches):
    """The reference read: PyTorch's EmbeddingBag with its own (dense) backward."""
    return F.embedding_bag(indices, pool.weight, per_sample_weights=weights.to(pool.weight.dtype), mode="sum")


def bench_memory(n_keys, path, x, grad_out, repeats) -> tuple[float, float, int]:
    """Seconds of forward + backward and of a training step of one MemoryPlus
    layer, and the distinct rows one step reads.

    path: "reference" (torch EmbeddingBag backward + torch AdamW defaults, as a
    plain PyTorch implementation would do), "dense" (memlm default: by-slot
    table gradient scattered densely + fused torch AdamW) or "sparse"
    (sparse_updates + SparseRowAdamW)."""
    sparse = path == "sparse"
    mem = MemoryPlus(DIM, n_keys=n_keys, heads=HEADS, knn=KNN, k_dim=K_DIM, sparse_updates=sparse)
    fused = path != "reference"
    if path == "reference":
        mem.values.reader = _native_reader
    values = value_parameters(mem)
    others = [p for p in mem.parameters() if all(p is not v for v in values)]
    value_opt = SparseRowAdamW(values, lr=1e-3) if sparse else torch.optim.AdamW(values, lr=1e-3, fused=fused)
    opts = [torch.optim.AdamW(others, lr=1e-4, fused=fused), value_opt]
    fwd_bwd, seconds = time_both(training_step(mem, [], x, grad_out), training_step(mem, opts, x, grad_out), repeats)
    with torch.no_grad():
        touched = int(mem.lookup(x)[1].unique().numel())
    del mem, values, others, value_opt, opts
    gc.collect()
    return fwd_bwd, seconds, touched


@torch.no_grad()
def bench_lookup(n_keys, repeats) -> tuple[float, float]:
    """Seconds per token: product-key top-k vs flat top-k over all n_keys**2 full keys (one head)."""
    gen = torch.Generator().manual_seed(0)
    half = K_DIM // 2
    sub_keys = torch.randn(1, 2, n_keys, half, generator=gen)
    q = torch.randn(TOKENS, 1, 2, half, generator=gen)
    pk = time_step(lambda: product_key_topk(subkey_scores(q, sub_keys), KNN), repeats) / TOKENS
    flat_keys = torch.randn(n_keys**2, K_DIM, generator=gen)  # (N, k_dim): 2 GB at 1M slots
    flat_tokens = 64
    qf = q[:flat_tokens].reshape(flat_tokens, K_DIM)

    def flat():
        for chunk in qf.split(16):
            (chunk @ flat_keys.t()).topk(KNN, dim=-1)

    flat_s = time_step(flat, max(1, repeats // 2)) / flat_tokens
    return pk, flat_s  # the 2 GB of flat keys are freed on return


def machine() -> str:
    return f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def render(rows, baseline, lookup, load_before, load_after, quick, repeats) -> str:
    """rows: per size, {path: (fwd_bwd, step)}; baseline: the FFN's (fwd_bwd, step)."""
    small, large = rows[0], rows[-1]
    growth = {k: [large[k][i] / small[k][i] for i in (0, 1)] for k in PATHS}
    pk, flat = lookup
    today = datetime.date.today().isoformat()
    lines = [
        SECTION,
        "",
        f"Machine: {machine()}. Date: {today}. Load average before/after the run: "
        f"{load_before} / {load_after}." + (" Quick mode (smaller sizes)." if quick else ""),
        "",
        f"One layer on {TOKENS} tokens at dim {DIM}: forward + backward (fwd+bwd), and one training "
        f"step (step: forward + backward + optimizer step), each the fastest of {repeats} "
        f"(reference: of 1), the two measured in turn. Baseline: dense SwiGLU FFN (hidden 1536) "
        "with fused torch AdamW, "
        f"fwd+bwd {baseline[0] * 1e3:.0f} ms, step {baseline[1] * 1e3:.0f} ms. MemoryPlus: {HEADS} "
        f"heads x knn {KNN}, k_dim {K_DIM}, v_dim {DIM}, one table. Paths: **reference** = torch "
        "EmbeddingBag backward (dense table gradient) + torch AdamW defaults; **dense** = memlm's "
        "default read (by-slot table gradient, scattered into a dense tensor) + fused torch AdamW; "
        "**sparse** = `memory.sparse_updates=true` + SparseRowAdamW (rows read only).",
        "",
        "| slots | rows read / step (distinct) | reference fwd+bwd | reference step "
        "| dense fwd+bwd | dense step | sparse fwd+bwd | sparse step |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = " | ".join(
            f"{r[k][i] * 1e3:.0f} ms ({r[k][i] / baseline[i]:.2f}x)" for k in PATHS for i in (0, 1)
        )
        lines.append(f"| {r['slots']:,} | {r['touched']:,} | {cells} |")
    span = f"from {small['slots']:,} to {large['slots']:,} slots"
    lines += [
        "",
        "(x) = time / the dense FFN's time for the same work (fwd+bwd, or step).",
        "",
        f"- Growth {span}, forward + backward (the issue's figure; the goal is judged on it): "
        f"sparse path {growth['sparse'][0]:.2f}x (goal <= 1.5x: {_met(growth['sparse'][0] <= 1.5)}), "
        f"dense path {growth['dense'][0]:.2f}x, reference {growth['reference'][0]:.2f}x.",
        f"- Growth {span}, full training step (with the optimizer; extra information): sparse path "
        f"{growth['sparse'][1]:.2f}x, dense path {growth['dense'][1]:.2f}x, reference "
        f"{growth['reference'][1]:.2f}x.",
        f"- Lookup at {large['slots']:,} slots, one head, forward, per token: product keys "
        f"{pk * 1e6:.1f} us, flat scoring of every slot {flat * 1e6:.0f} us: "
        f"{flat / pk:.0f}x faster (goal >= 20x: {_met(flat / pk >= 20)}).",
        "- The cores may be shared with other jobs (see the load average above), so absolute "
        "times are noisy; each figure is the fastest of its repeats.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="n_keys 32..128 and 1 repeat (smoke run)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--no-write", action="store_true", help=f"print only, do not update {DOC.name}")
    args = parser.parse_args(argv)
    n_keys_list = [32, 64, 128] if args.quick else [128, 256, 512, 1024]
    repeats = 1 if args.quick else args.repeats
    load_before = f"{os.getloadavg()[0]:.2f}"
    torch.manual_seed(0)
    x = torch.randn(TOKENS, DIM, requires_grad=True)  # as in a model: the input needs its gradient
    grad_out = torch.randn(TOKENS, DIM)
    started = time.perf_counter()
    baseline = bench_dense_ffn(x, grad_out, repeats)
    print(f"dense SwiGLU FFN: fwd+bwd {baseline[0] * 1e3:.0f} ms, step {baseline[1] * 1e3:.0f} ms", flush=True)
    rows = []
    for n_keys in n_keys_list:
        row = {"n_keys": n_keys, "slots": n_keys**2}
        for path in PATHS:
            # The reference path costs seconds per step at 1M slots: time it once.
            reps = 1 if path == "reference" else repeats
            fwd_bwd, step, row["touched"] = bench_memory(n_keys, path, x, grad_out, reps)
            row[path] = (fwd_bwd, step)
        rows.append(row)
        print(
            f"{n_keys**2:>9,} slots ({row['touched']:,} rows read): "
            + ", ".join(f"{k} fwd+bwd {row[k][0] * 1e3:5.0f} ms / step {row[k][1] * 1e3:5.0f} ms" for k in PATHS),
            flush=True,
        )
    lookup = bench_lookup(n_keys_list[-1], repeats)
    print(f"lookup per token: product keys {lookup[0] * 1e6:.1f} us, flat {lookup[1] * 1e6:.0f} us", flush=True)
    load_after = f"{os.getloadavg()[0]:.2f}"
    text = render(rows, baseline, lookup, load_before, load_after, args.quick, repeats)
    print("\n" + text)
    if not args.no_write:
        write_section(SECTION, text)
        print(f"wrote {DOC}")
    print(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
