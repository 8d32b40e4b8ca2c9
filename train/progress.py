"""Progress of a training run: the record and console line of a logging step.

    progress = Progress(cfg, env, model, first_step=trainer.step, tokens=trainer.tokens)
    record, line = progress.report(step, tokens, metrics, nonfinite_total, model)
    logger.log(record, line)

    logging = Logging(cfg, env, model, first_step, counters)   # both, on the loop (memlm.train.extensions)
    run.read = logging.due(step, run.last_step)                # the loop reads metrics on the host then
    logging.step_end(step, run)

The record holds the step's metrics (read from the device by StepGuard),
tokens/s over the window since the previous logging step, MFU where the
device's peak is known, peak memory, skipped non-finite steps and the memory
layers' health metrics; the line is its one-line console form with the ETA.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from torch import nn

from memlm.config.run import Config
from memlm.distributed import memory_hooks
from memlm.distributed.env import DistEnv
from memlm.train.metrics import MetricsLogger, device_peak_flops, format_eta, peak_memory_gib


class Progress:
    def __init__(self, cfg: Config, env: DistEnv, model: nn.Module, first_step: int, tokens: int):
        self.cfg, self.env = cfg, env
        self.flops_per_token = 3 * model.flops_per_token(cfg.data.seq_len)  # forward + backward
        self.peak = device_peak_flops(env.device)
        self.start = self.window_start = time.perf_counter()
        self.first_step, self.window_tokens = first_step, tokens

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def report(self, step: int, tokens: int, metrics: dict[str, float], nonfinite_total: int,
               model: nn.Module) -> tuple[dict[str, Any], str]:
        now = time.perf_counter()
        tps = (tokens - self.window_tokens) / max(now - self.window_start, 1e-9)
        self.window_start, self.window_tokens = now, tokens
        record = {"step": step, "tokens": tokens, **metrics, "tokens_per_s": tps,
                  "peak_mem_gib": peak_memory_gib(self.env.device), "nonfinite_skipped": nonfinite_total}
        if self.peak:
            record["mfu"] = tps * self.flops_per_token / (self.peak * self.env.world_size)
        record.update(memory_hooks.health_metrics(model))
        eta = (now - self.start) / max(step - self.first_step, 1) * (self.cfg.steps - step)
        return record, self.console_line(record, eta)

    def console_line(self, r: dict[str, Any], eta: float) -> str:
        parts = [f"step {r['step']}/{self.cfg.steps}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}",
                 f"gnorm {r['grad_norm']:.3f}"]
        if r.get("value_grad_norm"):  # the value tables' own norm (all that trains with finetune=memory|sparse)
            parts.append(f"vgnorm {r['value_grad_norm']:.3f}")
        parts.append(f"tok/s {r['tokens_per_s']:,.0f}")
        if "mfu" in r:
            parts.append(f"mfu {r['mfu']:.1%}")
        parts += [f"mem {r['peak_mem_gib']:.2f}GiB", f"eta {format_eta(eta)}"]
        usage = {k: v for k, v in r.items() if k.startswith("memory/") and k.endswith("usage")}
        if usage:
            parts.append("usage " + " ".join(f"{v:.1%}" for v in usage.values()))
        return "[train] " + "  ".join(parts)


class Logging:
    """The logging steps: every `logging.every` steps and a fit's last. Their metrics are read on
    the host, logged (metrics.jsonl, wandb, TensorBoard) and printed; `logger` is the run's
    MetricsLogger, which validation and evaluation log through too. `counters()`: the run's
    (tokens, skipped non-finite steps) as of now."""

    def __init__(self, cfg: Config, env: DistEnv, model: nn.Module, first_step: int,
                 counters: Callable[[], tuple[int, int]]):
        self.cfg, self.model, self.counters = cfg, model, counters
        self.logger = MetricsLogger(Path(cfg.dump_dir), env.is_main, cfg.name,
                                    OmegaConf.to_container(OmegaConf.structured(cfg)), cfg.logging.wandb,
                                    cfg.logging.tensorboard, start_step=first_step)
        if env.is_main:
            counts = model.num_params()
            print(f"[train] {cfg.name}: {counts['total']:,} params ({counts['active']:,} active), {env.world_size} "
                  f"rank(s) on {env.device.type}, accumulation {cfg.accumulation_steps(env.world_size)}, "
                  f"{cfg.steps} steps -> {cfg.dump_dir}", flush=True)
        self.progress = Progress(cfg, env, model, first_step, counters()[0])

    def due(self, step: int, last_step: int) -> bool:
        return step % self.cfg.logging.every == 0 or step == last_step

    def step_end(self, step: int, run) -> None:
        if run.read:
            tokens, nonfinite = self.counters()
            self.logger.log(*self.progress.report(step, tokens, run.metrics, nonfinite, self.model))

    def close(self) -> None:
        self.logger.close()
