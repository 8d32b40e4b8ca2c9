"""Training metrics: one console line per `logging.every` steps, the same
record in `dump_dir/metrics.jsonl`, wandb (offline by default) and, with
logging.tensorboard=true, TensorBoard events in `dump_dir/tensorboard`
(the same scalars wandb gets, under the same names, at the same step).

One row per step: a run that resumes from step S (or starts over at 0)
first moves the rows past S, written by an attempt that was killed or rolled
back, to `metrics.abandoned.jsonl` beside it (`trim_metrics`), so every
reader of metrics.jsonl sees the history that the weights actually have.

    logger = MetricsLogger(dump_dir, is_main, name, config, cfg.logging.wandb, start_step=step)
"""

from __future__ import annotations

import importlib.util
import json
import resource
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from memlm.errors import ConfigError
from memlm.files import atomic_write_text

if TYPE_CHECKING:
    from memlm.config.run import WandbConfig

# Dense bf16 tensor-core peak per GPU, for MFU. Unknown devices report no MFU.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def check_tensorboard(enabled: bool) -> None:
    """Fail before training when logging.tensorboard is on and TensorBoard is not installed."""
    if enabled and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logging.tensorboard", True, "false, or install TensorBoard first: "
                          "pip install 'memlm[tensorboard]' (or pip install tensorboard)")


ABANDONED = "metrics.abandoned.jsonl"


def trim_metrics(path: Path, step: int) -> int:
    """Move the rows of `path` past `step` (and any half-written line a kill left)
    to metrics.abandoned.jsonl beside it, each marked with the step the run went
    back to; the rest stay in order. Returns how many rows moved."""
    if not path.is_file():
        return 0
    kept, moved = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and row.get("step", 0) <= step:
            kept.append(line)
        else:
            moved.append(json.dumps({"abandoned_at_step": step, **row}) if isinstance(row, dict)
                         else json.dumps({"abandoned_at_step": step, "unreadable": line}))
    if moved:
        with (path.parent / ABANDONED).open("a") as f:  # first: a kill in between loses no row
            f.write("\n".join(moved) + "\n")
        atomic_write_text(path, "".join(f"{line}\n" for line in kept))
    return len(moved)


class MetricsLogger:
    def __init__(self, dump_dir: Path, is_main: bool, run_name: str, config: dict, wandb_cfg: WandbConfig,
                 tensorboard: bool = False, start_step: int = 0):
        self.is_main = is_main
        self.path = dump_dir / "metrics.jsonl"
        if is_main and (moved := trim_metrics(self.path, start_step)):
            print(f"[train] {self.path}: {moved} row(s) past step {start_step}, from an attempt this run does not "
                  f"continue, moved to {dump_dir / ABANDONED}", flush=True)
        self.wandb = None
        self.tensorboard = None
        if is_main and tensorboard:
            check_tensorboard(tensorboard)
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(dump_dir / "tensorboard"))
        if is_main and wandb_cfg.mode != "disabled":
            import wandb

            self.wandb = wandb.init(
                project=wandb_cfg.project, entity=wandb_cfg.entity or None, name=run_name,
                tags=list(wandb_cfg.tags), config=config, mode=wandb_cfg.mode, dir=str(dump_dir),
                id=run_name.replace("/", "_"), resume="allow",
            )

    def log(self, record: dict[str, Any], line: str | None = None) -> None:
        if not self.is_main:
            return
        record = {"time": round(time.time(), 3), **record}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {k: v for k, v in record.items() if k != "step"}
        if self.wandb is not None:
            self.wandb.log(scalars, step=record.get("step"))
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, global_step=record.get("step"))
        if line:
            print(line, flush=True)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()  # flushes the event file
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def format_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
