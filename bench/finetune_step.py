"""Benchmark: the step time of each fine-tuning mode against a full step (CPU, ~2 minutes).

    python bench/finetune_step.py

One Memory+ model (train_step.py's shape: dim 256, 6 layers, 3 Memory+
layers sharing a 16K-slot table), initialized from the same checkpoint,
trained by every fine-tuning mode (full, memory, sparse at top_t 1,000 with KL, lora at rank 8);
the modes' steps run in turn on the same batches (medians of interleaved
steps, in this process) and each is reported as a ratio to the full step.
Figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine_line, write_section  # noqa: E402
from train_step import MEMPLUS, MODEL, batches  # noqa: E402

from memlm.config.run import compose  # noqa: E402
from memlm.finetune.modes import MODES  # noqa: E402
from memlm.train.trainer import Trainer  # noqa: E402

TITLE = "## Fine-tuning step (bench/finetune_step.py)"
COMMON = [*MODEL, *MEMPLUS, "logging.wandb.mode=disabled", "val_batches=0", "optim.warmup=0"]
def variants() -> dict[str, list[str]]:
    """label -> overrides: every fine-tune mode (memlm.finetune.modes.MODES, the first is the baseline of
    the ratios), top_t 1,000 for a mode that reads one, which is then timed with SGD on the values too."""
    out = {}
    for name, mode in MODES.items():
        if "top_t" not in mode.reads:
            out[name] = [f"finetune={name}"]
            continue
        out[f"{name} (top_t 1,000)"] = [f"finetune={name}", "finetune.top_t=1000"]
        out[f"{name}, SGD"] = [*out[f"{name} (top_t 1,000)"], "finetune.optimizer=sgd", "memory.value_lr=10"]
    return out


VARIANTS = variants()
BASELINE = next(iter(VARIANTS))
WARMUP, REPEATS = 2, 7


def main() -> int:
    torch.manual_seed(0)
    header = machine_line()
    print(header)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        Trainer(compose([*COMMON, "steps=1", "checkpoint.slot_usage_steps=1", f"dump_dir={base}"])).fit()
        (ckpt,) = (base / "checkpoints").glob("step_*")
        feeds: dict[str, list] = {}
        trainers = {}
        for name, extra in VARIANTS.items():
            feeds[name] = []
            cfg = compose([*COMMON, *extra, f"init_from={ckpt}", "steps=100", f"dump_dir={tmp}/{len(trainers)}"])
            trainers[name] = Trainer(cfg, train_loader=iter(lambda f=feeds[name]: f.pop(), None))
        data = batches(WARMUP + REPEATS, trainers[BASELINE].cfg)
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for i, (x, y) in enumerate(data):
            for name, trainer in trainers.items():
                feeds[name].append((x, y))
                start = time.perf_counter()
                trainer.train_step(read=False)
                if i >= WARMUP:
                    times[name].append(time.perf_counter() - start)
        for trainer in trainers.values():
            trainer.close()
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    lines = ["| mode | step | vs full |", "|---|---:|---:|"]
    for name in VARIANTS:
        lines.append(f"| {name} | {med[name]:.0f} ms | {med[name] / med[BASELINE]:.2f}x |")
        print(lines[-1])
    body = "\n".join([
        header, "",
        f"One optimizer step of a Memory+ model (bench/train_step.py's shape: dim 256, 6 layers, 3 Memory+ "
        f"layers sharing 16,384 slots, {MODEL[-1].split('=')[1]} x {MODEL[-2].split('=')[1]} tokens) in each "
        f"fine-tuning mode, from the same checkpoint, on the same batches; median of {REPEATS} interleaved "
        f"steps after {WARMUP} warm-up, {torch.get_num_threads()} torch thread(s).", "",
        *lines,
    ])
    write_section(TITLE, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
