"""Print a model's parameter counts and FLOPs per token without allocating it.

    python -m memlm.plan.describe model=373m memory=memplus
    python -m memlm.plan.describe --all-presets
"""

from __future__ import annotations

import argparse
import sys

import torch

from memlm.config.run import compose, group_options
from memlm.errors import entry_point
from memlm.model import Transformer


def describe_row(overrides: list[str], seq_len: int | None) -> dict:
    cfg = compose(overrides)
    with torch.device("meta"):
        model = Transformer(cfg.model, cfg.memory)
    seq = seq_len or cfg.data.seq_len
    counts = model.num_params()
    return {
        "model": cfg.model.name,
        "memory_kind": cfg.memory.kind,
        **counts,
        "seq_len": seq,
        "flops_per_token": model.flops_per_token(seq),
    }


def format_table(rows: list[dict]) -> str:
    cols = [("model", "model"), ("memory_kind", "memory"), ("total", "total"), ("active", "active"),
            ("dense", "dense"), ("embedding", "embedding"), ("memory", "memory_params"),
            ("seq_len", "seq_len"), ("flops_per_token", "fwd_flops/token")]
    cells = [[f"{r[k]:,}" if isinstance(r[k], int) else str(r[k]) for k, _ in cols] for r in rows]
    widths = [max(len(title), *(len(row[i]) for row in cells)) for i, (_, title) in enumerate(cols)]
    lines = ["  ".join(title.ljust(w) for (_, title), w in zip(cols, widths))]
    for row in cells:
        lines.append("  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memlm.plan.describe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all-presets", action="store_true", help="one row per configs/model preset")
    parser.add_argument("--seq-len", type=int, default=None, help="context for attention FLOPs (default: data.seq_len)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=373m memory=memplus")
    args = parser.parse_args(argv)
    if args.all_presets:
        rows = [describe_row([f"model={p}", *args.overrides], args.seq_len) for p in group_options("model")]
    else:
        rows = [describe_row(args.overrides, args.seq_len)]
    print(format_table(rows))
    print("\nfwd_flops_per_token: forward FLOPs per token (a training step is ~3x).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
