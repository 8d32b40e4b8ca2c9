"""Evaluation during and after training: when it runs, and on what.

    evaluation = Evaluation(cfg, env, model, autocast, logger)   # on the loop (memlm.train.extensions)
    evaluation.step_end(step, run)   # every eval.every steps, before the last: run.evals
    evaluation.end(step, run)        # eval.after_training, once steps= is reached
    results = evaluation.run(step, checkpoint)   # now, on the live model

It runs on the live model, sharded as it trains: each rank scores its share
of the examples and the ranks keep their forwards in step
(memlm.evals.lockstep). No second copy of the weights is loaded. It computes
in the run's precision (its autocast or FSDP policy), as validation does;
compiled blocks run eagerly here, since evaluation shapes vary by batch.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from memlm.config.run import Config
from memlm.data.tokenizer import Tokenizer
from memlm.distributed.env import DistEnv
from memlm.distributed.parallelize import reshard
from memlm.evals import run_suite
from memlm.run.load import run_tokenizer_path
from memlm.train.metrics import MetricsLogger


class Evaluation:
    def __init__(self, cfg: Config, env: DistEnv, model: torch.nn.Module,
                 autocast: Callable[[], AbstractContextManager], logger: MetricsLogger):
        self.cfg, self.env, self.model, self.autocast, self.logger = cfg, env, model, autocast, logger

    def step_end(self, step: int, run) -> None:
        if self.due(step):
            run.evals = self.run(step, run.saved)

    def end(self, step: int, run) -> None:
        if self.due(step, last=True):
            run.evals = self.run(step, run.saved)

    def due(self, step: int, *, last: bool = False) -> bool:
        """During training every `eval.every` steps (not at the final step: the
        evaluation after training covers it); after it, with `eval.after_training`
        once the run has reached `steps`."""
        e = self.cfg.eval
        if last:
            return e.after_training and step == self.cfg.steps
        return bool(e.every) and step % e.every == 0 and step < self.cfg.steps

    def run(self, step: int, checkpoint: Path | None) -> dict[str, Any]:
        """The suite's results (also written to <dump_dir>/evals/<step>.json and logged)."""
        tokenizer = Tokenizer(run_tokenizer_path(self.cfg))
        meta = {"checkpoint": str(checkpoint)} if checkpoint is not None else {}
        try:
            with self.autocast(), torch.compiler.set_stance("force_eager"):
                results = run_suite(self.model, tokenizer, self.cfg.eval, step, Path(self.cfg.dump_dir) / "evals",
                                    self.env.rank, self.env.world_size, data_cfg=self.cfg.data, meta=meta)
        finally:
            reshard(self.model)  # the optimizer and checkpoints expect sharded parameters
        flat = {f"eval/{task}/{k}": v for task, metrics in results.items() for k, v in metrics.items()
                if isinstance(v, (int, float))}
        self.logger.log({"step": step, **flat})
        return results
