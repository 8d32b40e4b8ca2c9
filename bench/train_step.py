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

from memlm.config.run import compose  # noqa: E402
from memlm.distributed.clip import clip_group_  # noqa: E402
from memlm.model import build_model  # noqa: E402
from memlm.optim.build import build_optimizer  # noqa: E402
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


def bare_step(overrides: list[str]):
    """A hand-written step: forward, loss, backward, clip, AdamW (the baseline)."""
    cfg = compose(overrides)
    model = build_model(cfg.model, cfg.memory, seed=0).train()
    opt = build_optimizer(model, cfg, torch.device("cpu"))

    def step(x, y):
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        clip_group_(list(model.parameters()), cfg.optim.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def trainer_step(overrides: list[str], dump_dir: str, steps: int):
    cfg = compose([*overrides, f"dump_dir={dump_dir}", "logging.wandb.mode=disabled", f"steps={steps}"])
    feed: list = []
    trainer = Trainer(cfg, train_loader=iter(lambda: feed.pop(), None))

    def step(x, y):
        feed.append((x, y))
        trainer.train_step(read=False)  # as in a non-logging step of fit()

    return step


def median_times(steps: dict, data, warmup: int) -> dict[str, float]:
    """Round-robin over the variants, one step each in turn, so drifting
    background load affects all of them alike; median seconds per step."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i, (x, y) in enumerate(data):
        for name, step in steps.items():
            start = time.perf_counter()
            step(x, y)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


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
        t = median_times({
            "bare_d": bare_step(MODEL), "trainer_d": trainer_step(MODEL, f"{tmp}/d", steps),
            "bare_m": bare_step([*MODEL, *MEMPLUS]), "trainer_m": trainer_step([*MODEL, *MEMPLUS], f"{tmp}/m", steps),
        }, data, warmup)
    bare_d, trainer_d, bare_m, trainer_m = t["bare_d"], t["trainer_d"], t["bare_m"], t["trainer_m"]
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
        f"median of {steps - warmup} steps after {warmup} warm-up steps, the four variants "
        "measured in turn, one step each, on the same batches.", "",
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
