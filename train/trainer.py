"""The training loop: one code path for 1 process and torchrun jobs.

    python -m memlm.train model=tiny memory=memplus steps=200
    torchrun --nproc_per_node 2 -m memlm.train parallel.memory_parallel=2 ...

    trainer = Trainer(cfg)           # everything checked, built and restored; nothing trained
    trainer.extensions.add(part)     # a component on the loop's points (memlm.train.extensions)
    summary = trainer.fit()          # train to cfg.steps; summary.json

Order of construction: process group and meshes (memory_parallel resolved)
-> data loaders and the run's input checks (nothing written yet) -> the run
folder's lock -> model (memlm.run.model) -> value-gradient
reduction -> optimizer and schedule -> checkpointer and restore -> loop.
The loop knows no component by name: logging, validation, saving,
evaluation, slot usage, profiling and preemption each decide when a step is
theirs; the memory layers' and the fine-tune mode's step needs sit on the
same points.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from memlm.checkpoint.checkpointer import Checkpointer, TrainingState
from memlm.checkpoint.run_lock import RunLock, lock_run_dir
from memlm.config.run import Config, to_yaml
from memlm.distributed import memory_hooks
from memlm.distributed.clip import clip_group_, clip_in_step_
from memlm.distributed.env import current_env
from memlm.distributed.parallelize import parallelize
from memlm.distributed.precision import autocast, enable_tf32
from memlm.finetune.background import UsageRecorder
from memlm.finetune.modes import mode_of
from memlm.machine import run_environment
from memlm.memory.tables import split_params
from memlm.optim.build import build_optimizer, build_scheduler
from memlm.run.model import build_run_model, host_row_staging
from memlm.train.data_source import build_train_loader, has_validation, model_batch
from memlm.train.evaluation import Evaluation
from memlm.train.extensions import Extensions, RunRecord
from memlm.train.loss import chunked_cross_entropy
from memlm.train.metrics import check_tensorboard
from memlm.train.preemption import install_preemption_handler
from memlm.train.preflight import check_trainer_inputs
from memlm.train.profiling import StepProfiler
from memlm.train.progress import Logging
from memlm.train.restore import open_run_folder, restore
from memlm.train.saving import Saving
from memlm.train.step_guard import NonFiniteLossError, StepGuard, lower_hint, step_if_finite, step_ok
from memlm.train.summary import recorded_summary, run_summary, summary_line, write_summary
from memlm.train.validation import Validation

__all__ = ["NonFiniteLossError", "Trainer"]


class Trainer:
    def __init__(self, cfg: Config, train_loader: Any = None, val_loader: Any = None):
        self.run_lock: RunLock | None = None
        try:
            self._init(cfg, train_loader, val_loader)
        except BaseException:
            self.close()  # a run that failed to start gives its dump_dir back
            raise

    def _init(self, cfg: Config, train_loader: Any, val_loader: Any) -> None:
        self.cfg = cfg
        # The commit, torch and CPU the summary names: read now, as the code is imported (a checkout that
        # moves while the run trains would otherwise be named for code that never ran in it).
        self.environment = run_environment()
        self.env = env = current_env(cfg.device)  # the caller's ProcessGroup (memlm.train.cli) opens and closes it
        enable_tf32(env.device)
        self.meshes = memory_hooks.run_meshes(cfg, env, self._print_main)  # memory_parallel resolved
        self.accum = cfg.accumulation_steps(env.world_size)
        check_tensorboard(cfg.logging.tensorboard and env.is_main)  # before any file or model
        self.dump_dir = Path(cfg.dump_dir)
        # Data and eval tasks first: every file and the vocabulary are checked (reading
        # only) before the run folder is created or touched.
        self.train_loader = train_loader if train_loader is not None else self._default_loader("train")
        if val_loader is None and train_loader is None and cfg.val_batches and has_validation(cfg):
            val_loader = self._default_loader("val")
        self.val_loader = val_loader
        self.init_source = check_trainer_inputs(cfg)  # eval files, W&B login; what init_from names, read once
        if env.is_main:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
        # One run per dump_dir, taken before anything in it is written, cleaned or resumed.
        self.run_lock = lock_run_dir(self.dump_dir, env.is_main, env.distributed, env.device)
        self.model = build_run_model(cfg, env, self.meshes,
                                     wrap=lambda model: parallelize(model, self.meshes, cfg.parallel, env.device))
        self.params = split_params(self.model)  # (dense, sparse tables): clipped apart (memlm.memory.tables)
        self.value_grads = memory_hooks.value_grad_reduction(self.model, self.meshes, env, self.accum, cfg.memory)
        self.optimizer = build_optimizer(self.model, cfg, env.device)
        # What the fine-tune mode does between backward and step (sparse: the rows that may change)
        self.finetune = mode_of(cfg).step_hook(self.model, cfg, env.distributed, self.init_source)
        if (line := self.finetune.describe()) is not None:  # sparse: the background file it ranks against
            self._print_main(f"[train] {line}")
        # The step's own parts: the memory layers' (knn schedule, value-gradient reduction; host tables' rows
        # staged before each forward), the mode's.
        self.extensions = Extensions(memory_hooks.MemoryStep(self.model, cfg.memory, self.value_grads),
                                     *host_row_staging(self.model), self.finetune)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        # Per-step loss, norms and the skip flag stay on the device until a read.
        self.guard = StepGuard(cfg.max_nonfinite_steps, self._print_main, lower=lower_hint(mode_of(cfg), cfg))
        self.checkpointer = Checkpointer(self.dump_dir, cfg.checkpoint)
        self.checkpointer.recover()  # finish or undo a save a kill interrupted, before choosing one
        self.step, self.tokens = 0, 0  # a resume's TrainingState loads into these
        self.step, self.tokens, self.guard.nonfinite_total, self.resumed_from = restore(
            cfg, self.checkpointer, self.model, self._training_state, self.init_source,
            getattr(self.train_loader, "tokenizer", None), self._print_main)
        self.nothing_to_train = open_run_folder(cfg, env.is_main, self.checkpointer, self.step, self.resumed_from)

    @property
    def nonfinite_total(self) -> int:
        """Steps skipped for a non-finite loss or gradient norm, as of the last host read."""
        return self.guard.nonfinite_total

    def _print_main(self, line: str) -> None:
        if self.env.is_main:
            print(line, flush=True)

    def save_checkpoint(self) -> Path:
        """Save now (a preemption, a test); the loop's saves are the checkpointer's to time."""
        return self.checkpointer.save(self.step, self._training_state())

    def _training_state(self) -> TrainingState:
        self.guard.read(report=False)  # skip count and stop rule up to date before anything is written
        return TrainingState(self.model, self.optimizer, self.scheduler, self.train_loader,
                             {"tokens": self.tokens, "nonfinite_total": self.nonfinite_total}, to_yaml(self.cfg),
                             self.val_loader)

    def _default_loader(self, split: str):
        return build_train_loader(self.cfg, self.env, split)

    # ---------------------------------------------------------------- step
    def _autocast(self):
        """bf16 compute on one process (parallel.dtype; see distributed/precision.py)."""
        return autocast(self.cfg.parallel, self.env.device, fsdp=self.meshes.fsdp is not None)

    def _forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor,
                      doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        with self._autocast():
            logits = self.model(inputs, doc_ids=doc_ids)  # doc_ids: model.doc_mask (model/doc_mask.py)
            loss = chunked_cross_entropy(logits, targets)  # no fp32 copy of all the logits (train/loss.py)
            aux = self.model.aux_loss() if hasattr(self.model, "aux_loss") else None
        return loss if aux is None else loss + aux

    def train_step(self, read: bool = True) -> dict[str, float]:
        """One optimizer step over `accum` micro-batches. Nothing is read on the
        host unless `read` (then: the last step's metrics, see StepGuard.read;
        otherwise {}). A step whose loss or gradient norm is not finite changes
        no weight and no optimizer state (decided on the device)."""
        self.model.train()
        self.extensions.step_start(self.step + 1)
        loss_sum = torch.zeros((), device=self.env.device)
        for micro in range(self.accum):
            batch = next(self.train_loader)
            self.extensions.before_forward(batch[0])  # the tokens on the host (Engram's host tables stage rows)
            inputs, targets, doc_ids = model_batch(batch, self.env.device, self.cfg.model.doc_mask)
            if hasattr(self.model, "set_requires_gradient_sync"):
                self.model.set_requires_gradient_sync(micro == self.accum - 1)
            loss = self._forward_loss(inputs, targets, doc_ids) / self.accum
            loss.backward()
            loss_sum += loss.detach()
        self.extensions.after_backward()  # value gradients reduced; finetune=sparse: the selected rows alone
        if self.env.distributed:
            dist.all_reduce(loss_sum)  # every rank must agree on skipping: the global loss decides
            loss_sum /= self.env.world_size
        self.tokens += self.cfg.tokens_per_step(self.env.world_size)
        lr = self.scheduler.get_last_lr()[0]
        dense, tables = self.params
        gnorm = clip_group_(dense, self.cfg.optim.clip)
        # The tables' clip is applied by the optimizer's step, as it reads their gradients.
        vnorm = clip_in_step_(self.optimizer, tables, self.cfg.memory.value_grad_clip).to(gnorm.device) \
            if tables else torch.zeros_like(gnorm)  # .to: a norm over host tables alone is on the host
        ok = step_ok(loss_sum, gnorm, vnorm)  # norms are global: every rank gets the same flag
        step_if_finite(self.optimizer, ok)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()  # a skipped step is consumed (its data and schedule slot) like any other
        self.step += 1
        self.guard.record(self.step, lr, loss_sum, gnorm, vnorm, ok)
        return self.guard.read() if read else {}

    # ---------------------------------------------------------------- loop
    def fit(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train until `cfg.steps` (or `stop_after` steps, e.g. a time slot
        before a requeue: the schedule still spans cfg.steps). The run's lock
        on dump_dir is held until everything, summary.json included, is written.
        A run with nothing to train writes nothing (the summary is the one recorded)."""
        try:
            return self._finish(0.0, RunRecord(self.step)) if self.nothing_to_train else self._fit(stop_after)
        finally:
            self.close()

    def _loop_parts(self, logging: Logging) -> list[object]:
        """The loop's components, in the order each point calls them (close: the reverse)."""
        cfg, env = self.cfg, self.env
        return [
            UsageRecorder(self.model, cfg.steps, cfg.checkpoint.slot_usage_steps,
                          cfg.tokens_per_step(env.world_size), env.distributed, self.dump_dir, env.is_main),
            StepProfiler(cfg.profile.steps, self.dump_dir, env.device, env.rank),
            logging,
            Validation(cfg, env, self.model, self.val_loader, self._autocast, logging.logger),
            Saving(self.checkpointer, self._training_state),
            Evaluation(cfg, env, self.model, self._autocast, logging.logger),
            # SIGUSR1 or SIGTERM (Slurm: before the time limit, preemption) -> checkpoint after the step and stop.
            install_preemption_handler(
                lambda: self.save_checkpoint() if self.checkpointer.saved_step != self.step else None),
        ]

    def _fit(self, stop_after: int | None) -> dict[str, Any]:
        cfg, env = self.cfg, self.env
        run = RunRecord(last_step=cfg.steps if stop_after is None else min(cfg.steps, stop_after))
        first_step = self.step
        logging = Logging(cfg, env, self.model, first_step, lambda: (self.tokens, self.nonfinite_total))
        loop = Extensions(*self._loop_parts(logging))
        start = logging.progress.elapsed
        try:
            while self.step < run.last_step and not run.stop:
                step = self.step + 1
                # Device values reach the host only at logging steps (and in saves,
                # evaluations and validation): the other steps never wait.
                run.read = logging.due(step, run.last_step)
                loop.step_start(step)
                run.metrics = self.train_step(read=run.read) or run.metrics
                loop.step_end(step, run)
            if run.stop:
                run.metrics = self.guard.read() or run.metrics  # steps since the last logging step (one process)
            elif self.step > first_step:  # a finished run resumed has done all of this already
                loop.end(self.step, run)
        finally:
            loop.close()
        return self._finish(start(), run)

    def close(self) -> None:
        """Give the dump_dir back (the run lock); fit() does it when it ends."""
        if self.run_lock is not None:
            self.run_lock.release()

    def _finish(self, seconds: float, run: RunRecord) -> dict[str, Any]:
        """summary.json, on rank 0: this fit's, or with nothing to train the recorded one (if it is this step's)."""
        summary = run_summary(name=self.cfg.name, steps=self.step, tokens=self.tokens, metrics=run.metrics,
                              val_loss=run.val_loss, evals=run.evals, nonfinite_skipped=self.nonfinite_total,
                              preempted=run.stop, seconds=seconds, dump_dir=self.dump_dir,
                              environment=self.environment)
        if self.env.is_main:
            summary = (recorded_summary(summary, self.dump_dir) if self.nothing_to_train
                       # nothing trained (a requeue of a finished run): keep the results already reported
                       else write_summary(self.dump_dir, summary, trained=bool(run.metrics)))
            print(summary_line(summary), flush=True)
        return summary
