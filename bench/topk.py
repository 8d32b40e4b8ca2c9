"""Benchmark: CPU top-k of short rows, memlm's C kernel vs torch.topk (~1 minute).

    python bench/topk.py

Product-key search takes top-k over the n_keys sub-key scores of every token,
head and key half, then over ~knn*ln(knn) candidate sums per token and head.
Measured here, in this process, on the same inputs: memlm.memory.fast.native_topk
(memory/fast/topk_rows.c, one row per SIMD lane through a sorting network) against
torch.topk(sorted=True), the rows alone and the whole search forward
(memlm.memory.fast.search.topk_with_ranks) with each top-k; at 1 torch thread
(how the study runs train, OMP_NUM_THREADS=1) and 2. Medians of interleaved
repeats; figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine_line, median_ms, write_section  # noqa: E402

import memlm.memory.fast.search as search  # noqa: E402
from memlm.memory.fast import native_topk  # noqa: E402

TITLE = "## Top-k of short rows (bench/topk.py)"
K = 32
# (label, rows, n): sub-key rows of bench/train_step.py (2048 tokens x 4 heads x 2 halves)
# and of the ablation (4096 tokens), the candidate sums, and block maxima at 1M slots.
ROWS = [("sub-key scores, 2,048 tokens", 16384, 128), ("sub-key scores, 4,096 tokens", 32768, 128),
        ("candidate sums, 2,048 tokens", 8192, 119), ("block maxima at n_keys 1024", 16384, 256)]
SEARCH_TOKENS = 2048


def torch_topk(x: torch.Tensor, k: int):
    return x.topk(k, dim=-1)


def search_with(topk_fn, scores):
    search.rows_topk = topk_fn
    try:
        return search.topk_with_ranks(scores, K, ordered=False)
    finally:
        search.rows_topk = native_topk.topk


def main() -> int:
    if not native_topk.available():
        print("the native top-k kernel did not build on this machine (see the warning)", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    header = machine_line()
    print(header)
    lines = ["| work | torch threads | torch.topk | native | speedup |", "|---|---:|---:|---:|---:|"]
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(SEARCH_TOKENS, 4, 2, 64, generator=gen)
    keys = torch.randn(4, 2, 128, 64, generator=gen)
    scores = search.subkey_scores(query, keys)  # (T, H, 2, n_keys), a permuted view as in the layers
    a, b = search_with(torch_topk, scores), search_with(native_topk.topk, scores)
    # The same winning scores (slots may differ where float32 sums tie).
    assert torch.equal(a[0].sort(-1).values, b[0].sort(-1).values)
    for n_threads in (1, 2):
        torch.set_num_threads(n_threads)
        for label, rows, n in ROWS:
            x = torch.randn(rows, n, generator=gen)
            assert torch.equal(native_topk.topk(x, K)[0], x.topk(K, dim=-1)[0])
            t = median_ms({"torch": lambda x=x: x.topk(K, dim=-1), "native": lambda x=x: native_topk.topk(x, K)})
            lines.append(f"| top-{K} of {rows:,} rows x {n} ({label}) | {n_threads} | {t['torch']:.1f} ms | "
                         f"{t['native']:.1f} ms | {t['torch'] / t['native']:.2f}x |")
        t = median_ms({"torch": lambda: search_with(torch_topk, scores),
                       "native": lambda: search_with(native_topk.topk, scores)})
        lines.append(f"| product-key search forward, {SEARCH_TOKENS:,} tokens x 4 heads, n_keys 128, knn {K} | "
                     f"{n_threads} | {t['torch']:.1f} ms | {t['native']:.1f} ms | {t['torch'] / t['native']:.2f}x |")
        print(lines[-1])
    torch.set_num_threads(threads)
    body = "\n".join([
        header, "",
        "memlm.memory.fast.native_topk (memory/fast/topk_rows.c) against torch.topk, sorted top-32, float32, "
        "median of 9 interleaved repeats; outputs checked equal first. The search row runs "
        "memlm.memory.fast.search.topk_with_ranks (half top-k, candidate sums, final top-k) with each.", "",
        *lines, "",
        "- With more than one torch thread the kernel splits the rows over torch's own OpenMP "
        "threads (memory/fast/topk_rows.c).",
    ])
    print(body)
    write_section(TITLE, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
