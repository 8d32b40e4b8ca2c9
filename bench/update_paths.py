"""Benchmark: the table's backward + update, dense gradient buffer against sparse rows, by read share.

    python bench/update_paths.py [--slots 262144] [--v-dim 256] [--no-doc]      # CPU here; CUDA where present

The choice memory.sparse_updates makes for a value table, measured where
only that choice differs: one table of N slots, L = 3 reads of it per step
(Memory+'s three layers), each read of B bags x K rows spread evenly over
the table, at read shares (distinct rows a step touches / N) from under 1%
to nearly all. Per step and path, from the reads' output gradients:

- dense (the default): each read's backward adds into the table's kept
  gradient buffer (`embedding_bag(..., grad_into=)`), then the clip's norm
  and `table_adamw_` over all N rows (memlm.memory.table_grads);
- sparse (memory.sparse_updates=true): each read's backward makes sparse
  rows, autograd sums them, then the sparse norm and SparseRowAdamW over the
  touched rows only (lazy: unread rows keep their moments, see memlm.memory.sparse_adamw).

Each line gives both medians and the ratio sparse / dense (below 1: sparse
is faster); both run interleaved in this process. Figures go to
docs/benchmarks.md with the machine. The lazy update is not the same
optimizer (unread rows are frozen), so speed alone does not make it the
default: the doc section says what the figures decide.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine_line, median_ms, write_section  # noqa: E402

from memlm.distributed.clip import clip_in_step_  # noqa: E402
from memlm.memory.fast.ops import embedding_bag  # noqa: E402
from memlm.memory.sparse_adamw import SparseRowAdamW  # noqa: E402
from memlm.memory.table_adamw import TableAdamW  # noqa: E402
from memlm.memory.table_grads import TABLES  # noqa: E402
from memlm.plan.table_traffic import expected_rows  # noqa: E402

TITLE = "## Table update: dense buffer against sparse rows (bench/update_paths.py)"
LAYERS, READS_PER_BAG = 3, 32


def _step(table, opt, reads, grads, sparse: bool):
    """One step's table work: L reads' backward, the clip's norm, the update."""
    outs = [embedding_bag(table, idx, w, sparse=sparse,
                          grad_into=None if sparse else table.grad) for idx, w in reads]
    torch.autograd.backward(outs, grads)
    clip_in_step_(opt, [table], 1.0)
    opt.step()
    opt.zero_grad()


def measure(slots: int, v_dim: int, bags: int, device: torch.device, repeats: int) -> dict[str, float]:
    g = torch.Generator(device="cpu").manual_seed(0)
    reads = [(torch.randint(0, slots, (bags, READS_PER_BAG), generator=g).to(device),
              torch.rand(bags, READS_PER_BAG, generator=g).to(device)) for _ in range(LAYERS)]
    grads = [torch.randn(bags, v_dim, generator=g).to(device) for _ in range(LAYERS)]
    paths = {}
    for name, sparse in (("dense", False), ("sparse", True)):
        table = torch.nn.Parameter(torch.randn(slots, v_dim, generator=g).to(device) * v_dim**-0.5)
        group = {"params": [table], TABLES: not sparse}
        opt = SparseRowAdamW([group], lr=1e-3) if sparse else TableAdamW([group], lr=1e-3)
        paths[name] = (lambda t=table, o=opt, s=sparse: _step(t, o, reads, grads, s))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    timed = {k: (lambda f=f: (f(), sync())) for k, f in paths.items()}
    return median_ms(timed, repeats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=1 << 18)
    parser.add_argument("--v-dim", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lines = [machine_line(), "",
             f"One table of {args.slots:,} slots x {args.v_dim} ({device.type}, fp32), {LAYERS} reads per step of "
             f"B bags x {READS_PER_BAG} rows; read share = expected distinct rows touched / slots.", "",
             "| bags per read | read share | dense (ms) | sparse (ms) | sparse / dense |", "|---|---|---|---|---|"]
    for bags in (16, 128, 1024, 4096, 16384):
        share = expected_rows(LAYERS * bags * READS_PER_BAG, args.slots) / args.slots
        ms = measure(args.slots, args.v_dim, bags, device, args.repeats)
        line = (f"| {bags:,} | {share:.1%} | {ms['dense']:.1f} | {ms['sparse']:.1f} | "
                f"{ms['sparse'] / ms['dense']:.2f}x |")
        lines.append(line)
        print(line, flush=True)
    if not args.no_doc:
        write_section(TITLE, TITLE + "\n\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
