"""The "## Kernels (bench/kernels.py)" section of docs/benchmarks.md: bench/kernels.py's rows as markdown.

    cpu_markdown(rows, shape, threads)  # "### CPU: ..." ours against F.embedding_bag, the no-slower goal
    gpu_markdown(rows, sweeps, shape)   # "### GPU: ..." the Triton kernels, the launch sweep's table
    kept_part(doc, "GPU")               # the part an earlier run wrote, kept where this run measured none
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from report import machine_line

TITLE = "## Kernels (bench/kernels.py)"


def cpu_markdown(rows, shape, threads) -> str:
    tokens, reads, slots, v_dim = shape
    lines = ["### CPU: our PyTorch path (`memory.kernel=torch`) vs F.embedding_bag", "",
             machine_line() + f" {threads} torch thread(s); fastest of the interleaved repeats.", "",
             f"{tokens} tokens x {reads} reads, {slots:,} slots, v_dim {v_dim}.", "",
             "| table | table gradient | pass | ours | F.embedding_bag | F / ours |",
             "|---|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {'sparse' if r['sparse'] else 'dense'} | {r['pass_']} | "
                     f"{r['ours_ms']:.1f} ms | {r['ref_ms']:.1f} ms | {r['speedup']:.2f}x |")
    worst = min(r["speedup"] for r in rows if r["pass_"] == "fwd+bwd")
    lines += ["", "- F / ours > 1: ours is faster. Forward+backward computes the output, the table gradient and "
              f"the weights' gradient. Slowest case: {worst:.2f}x (goal >= 1, no slower: "
              f"{'met' if worst >= 1 else 'not met'}).",
              "- Sparse: ours is a coalesced COO gradient (one row per distinct slot, what SparseRowAdamW "
              "takes); F.embedding_bag(sparse=True) returns one uncoalesced row per read.",
              "- Forward effective bandwidth (rows read + output written): "
              + ", ".join(f"{r['dtype']} ours {r['ours_gbs']:.1f} GB/s vs {r['ref_gbs']:.1f} GB/s"
                          for r in rows if r["ours_gbs"]) + ".",
              "- The cores are shared with other jobs: single runs move by about 10%."]
    return "\n".join(lines)


def gpu_markdown(rows, sweeps, shape) -> str:
    tokens, reads, slots, v_dim = shape
    ref = {r["pass_"]: r["ms"] for r in rows if r["name"] == "F.embedding_bag"}
    lines = ["### GPU: Triton kernels vs F.embedding_bag", "", machine_line(), "",
             f"{tokens} tokens x {reads} reads, {slots:,} slots, v_dim {v_dim}, bf16 table, dense table "
             "gradient; median of CUDA-event timings.", "",
             "| kernel | pass | time | effective bandwidth | F.embedding_bag / this |", "|---|---|---:|---:|---:|"]
    if "fwd+bwd" not in ref and "fwd" in ref:
        lines[-2:-2] = [f"F.embedding_bag has no bf16 per-sample-weights backward on this device "
                        f"(torch {torch.__version__}): it is timed forward only.", ""]
    for r in rows:
        bw = f"{r['gbs']:.0f} GB/s" if r["gbs"] else "-"
        ratio = f"{ref[r['pass_']] / r['ms']:.2f}x" if r["pass_"] in ref else "-"
        lines.append(f"| {r['name']} | {r['pass_']} | {r['ms']:.3f} ms | {bw} | {ratio} |")
    if sweeps:
        from launch_sweep import sweep_markdown

        lines += sweep_markdown(sweeps)
    return "\n".join(lines)


def kept_part(doc: Path, heading: str) -> str:
    """The existing "### CPU..." or "### GPU..." part of the section, if any."""
    text = doc.read_text() if doc.exists() else ""
    section = re.search(rf"^{re.escape(TITLE)}\n.*?(?=^## |\Z)", text, re.S | re.M)
    part = re.search(rf"^### {heading}.*?(?=^### |\Z)", section.group(0), re.S | re.M) if section else None
    return part.group(0).strip() if part else ""
