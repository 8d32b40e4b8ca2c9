"""The validation loss during and after training: when it runs, and what it measures.

    validation = Validation(cfg, env, model, loader, autocast, logger)   # on the loop (memlm.train.extensions)
    validation.step_end(step, run)   # every val_every steps, before the last: run.val_loss
    validation.end(step, run)        # once more at the run's last step
    loss = validation.loss()         # now: the mean loss of val_batches batches, over every rank

Each measurement reads the next `val_batches` batches of the validation
stream, in the run's precision, on the live (sharded) model. A checkpoint
records the stream's position (memlm.checkpoint), so a resumed run measures
what the unbroken run measures.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist

from memlm.config.run import Config
from memlm.distributed.env import DistEnv
from memlm.distributed.parallelize import reshard
from memlm.train.data_source import model_batch
from memlm.train.loss import chunked_cross_entropy
from memlm.train.metrics import MetricsLogger


class Validation:
    def __init__(self, cfg: Config, env: DistEnv, model: torch.nn.Module, loader: Any,
                 autocast: Callable[[], AbstractContextManager], logger: MetricsLogger):
        self.cfg, self.env, self.model, self.loader = cfg, env, model, loader
        self.autocast, self.logger = autocast, logger

    def due(self, step: int) -> bool:
        """Every `val_every` steps, before the last (the end's validation covers it)."""
        return bool(self.cfg.val_every) and step % self.cfg.val_every == 0 and step < self.cfg.steps

    def step_end(self, step: int, run) -> None:
        if self.due(step):
            run.val_loss = self.log(step)

    def end(self, step: int, run) -> None:
        """At the run's last step, once more. A stop before it (fit's stop_after: a time slot) measures
        nothing more: its checkpoint holds the stream where the unbroken run has it, so the resumed
        run's measurements are the unbroken run's (the summary keeps the last measured loss)."""
        if self.loader is not None and step == self.cfg.steps:
            run.val_loss = self.log(step)

    def log(self, step: int) -> float | None:
        val = self.loss()
        if val is not None:
            self.logger.log({"step": step, "val_loss": val}, f"[train] step {step}  val_loss {val:.4f}")
        return val

    def loss(self) -> float | None:
        """The mean loss of the next val_batches batches (None without a validation stream)."""
        if self.loader is None or self.cfg.val_batches == 0:
            return None
        self.model.eval()
        total = torch.zeros((), device=self.env.device)
        for _ in range(self.cfg.val_batches):
            inputs, targets, doc_ids = model_batch(next(self.loader), self.env.device, self.cfg.model.doc_mask)
            with self.autocast():
                logits = self.model(inputs, doc_ids=doc_ids)
            total += chunked_cross_entropy(logits, targets)
        if self.env.distributed:
            dist.all_reduce(total)
            total /= self.env.world_size
        self.model.train()
        reshard(self.model)
        return total.item() / self.cfg.val_batches
