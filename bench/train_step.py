"""Benchmark: the trainer's overhead and the cost of Memory+ layers (CPU, ~2 minutes).

    python bench/train_step.py [--quick]

1. Trainer vs a bare PyTorch loop: the same model, batches, optimizer and
   clipping; the ratio of tokens/s (goal >= 0.9: the trainer's bookkeeping,
   schedules, guards and metrics cost little).
2. Memory+ vs dense: the step time of a model whose 3 FFNs (spread through
   the depth) are Memory+ layers sharing one pool, over the dense model of the
   same dims (goal <= 1.25).
Both are measured in this process; figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine_line, write_section  # noqa: E402

from memlm.model import build_model  # noqa: E402
from memlm.train.config import compose  # noqa: E402
from memlm.train.optim import build_optimizer, clip_  # noqa: E402
from memlm.train.trainer import Trainer  # noqa: E402

TITLE = "## Training step (bench/train_step.py)"
MODEL = ["model.dim=256", "model.n_layers=6", "model.n_heads=8", "model.vocab_size=4096",
         "model.multiple_of=64", "data.seq_len=256", "data.micro_batch=8"]
MEMPLUS = ["memory=memplus", "memory.layers=[]", "memory.spread=3", "memory.n_keys=128", "memory.heads=4",
           "memory.knn=32", "memory.eval_knn=32", "memory.k_dim=128"]


def batches(n: int, cfg) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        t = torch.randint(0, cfg.model.vocab_size, (cfg.data.micro_batch, cfg.data.seq_len + 1), generator=gen)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def time_bare(overrides: list[str], data, warmup: int) -> float:
    """Seconds per step of a hand-written loop: forward, loss, backward, clip, AdamW."""
    cfg = compose(overrides)
    model = build_model(cfg.model, cfg.memory if cfg.memory.kind != "none" else None, seed=0).train()
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    times = []
    for i, (x, y) in enumerate(data):
        start = time.perf_counter()
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        clip_(list(model.parameters()), cfg.optim.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_trainer(overrides: list[str], data, warmup: int, dump_dir: str) -> float:
    cfg = compose([*overrides, f"dump_dir={dump_dir}", "logging.wandb.mode=disabled", f"steps={len(data)}"])
    trainer = Trainer(cfg, train_loader=iter(data))
    times = []
    for i in range(len(data)):
        start = time.perf_counter()
        trainer.train_step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few steps: a smoke run, figures not written")
    args = parser.parse_args(argv)
    steps, warmup = (6, 2) if args.quick else (30, 5)
    torch.manual_seed(0)
    cfg = compose(MODEL)
    data = batches(steps, cfg)
    tokens = cfg.data.micro_batch * cfg.data.seq_len
    header = machine_line()
    print(header)
    with tempfile.TemporaryDirectory() as tmp:
        # Interleave the measurements so background load hits both alike.
        bare_d = time_bare(MODEL, data, warmup)
        trainer_d = time_trainer(MODEL, data, warmup, f"{tmp}/d")
        bare_m = time_bare([*MODEL, *MEMPLUS], data, warmup)
        trainer_m = time_trainer([*MODEL, *MEMPLUS], data, warmup, f"{tmp}/m")
    rows = [
        ("dense", bare_d, trainer_d),
        ("Memory+ (3 layers, 16K slots shared)", bare_m, trainer_m),
    ]
    lines = ["| model | bare loop tokens/s | trainer tokens/s | trainer / bare |", "|---|---|---|---|"]
    for name, bare, tr in rows:
        lines.append(f"| {name} | {tokens / bare:,.0f} | {tokens / tr:,.0f} | {bare / tr:.2f} |")
    ratio = trainer_m / trainer_d
    body = "\n".join([
        header, "",
        f"Model: dim 256, 6 layers, 8 heads, vocab 4096, seq_len 256 x micro_batch 8 ({tokens} tokens/step); "
        f"median of {steps - warmup} steps after {warmup} warm-up steps.", "",
        *lines, "",
        f"- Trainer / bare loop (dense): {bare_d / trainer_d:.2f} (goal >= 0.9).",
        f"- Memory+ / dense step time in the trainer: {ratio:.2f} (goal <= 1.25).",
    ])
    print(body)
    if not args.quick:
        write_section(TITLE, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
