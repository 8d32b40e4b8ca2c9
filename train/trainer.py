"""The training loop: one code path for 1 process and torchrun jobs.

    python -m memlm.train model=tiny memory=memplus steps=200
    torchrun --nproc_per_node 2 -m memlm.train parallel.memory_parallel=2 ...

Order of construction: process group and meshes (memory_parallel resolved)
-> data loaders and the run's input checks (nothing written yet) -> the run
folder's lock -> model (full init on CPU, or meta for sharded init; memory
parallelism, activation checkpointing, compile, FSDP2) -> value-gradient
reduction -> optimizer and schedule -> checkpointer and restore -> loop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from memlm.checkpoint.checkpointer import Checkpointer, TrainingState
from memlm.checkpoint.run_lock import RunLock, lock_run_dir
from memlm.config.run import Config, to_yaml
from memlm.distributed import memory_hooks
from memlm.distributed.clip import clip_group_, clip_in_step_
from memlm.distributed.env import build_meshes, current_env, seed_everything, shard_index
from memlm.distributed.parallelize import (
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
    reshard,
)
from memlm.distributed.precision import autocast, enable_tf32
from memlm.errors import ConfigError
from memlm.files import atomic_write_text
from memlm.finetune.background import UsageRecorder
from memlm.finetune.modes import mode_of
from memlm.hf.importer import import_init
from memlm.hf.load import keep_tokenizer
from memlm.memory.tables import split_params
from memlm.model import Transformer
from memlm.model.lora import reset_lora
from memlm.train.data_source import build_train_loader, has_validation, model_batch
from memlm.train.evaluation import Evaluation
from memlm.train.loss import chunked_cross_entropy
from memlm.train.metrics import MetricsLogger, check_tensorboard
from memlm.train.optim import build_optimizer, build_scheduler
from memlm.train.preemption import install_preemption_handler
from memlm.train.preflight import check_eval_inputs, check_init_from, check_wandb_login
from memlm.train.profiling import StepProfiler
from memlm.train.progress import Progress
from memlm.train.step_guard import NonFiniteLossError, StepGuard, lower_hint, step_if_finite, step_ok
from memlm.train.summary import run_summary, summary_line, write_summary

__all__ = ["NonFiniteLossError", "Trainer", "accumulation_steps"]


def accumulation_steps(cfg: Config, world_size: int) -> int:
    per_micro = cfg.data.micro_batch * cfg.data.seq_len * world_size
    if cfg.global_batch_tokens == 0:
        return 1
    if cfg.global_batch_tokens % per_micro:
        raise ConfigError(
            "global_batch_tokens", cfg.global_batch_tokens,
            f"a multiple of data.micro_batch x data.seq_len x data-parallel ranks = "
            f"{cfg.data.micro_batch} x {cfg.data.seq_len} x {world_size} = {per_micro}",
        )
    return cfg.global_batch_tokens // per_micro


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
        self.env = current_env(cfg.device)  # the caller's ProcessGroup (memlm.train.cli) opens and closes it
        enable_tf32(self.env.device)
        world, per_node = self.env.world_size, self.env.local_world_size
        self.meshes = build_meshes(self.env, memory_hooks.resolve_memory_parallel(cfg, world, per_node),
                                   cfg.parallel.fsdp)
        if warning := memory_hooks.value_grad_warning(cfg, world, per_node):
            self._print_main(f"[train] warning: {warning}")
        self.accum = accumulation_steps(cfg, self.env.world_size)
        check_tensorboard(cfg.logging.tensorboard and self.env.is_main)  # before any file or model
        self.dump_dir = Path(cfg.dump_dir)
        # Data and eval tasks first: every file and the vocabulary are checked (reading
        # only) before the run folder is created or touched.
        self.train_loader = train_loader if train_loader is not None else self._default_loader("train")
        if val_loader is None and train_loader is None and cfg.val_batches and has_validation(cfg):
            val_loader = self._default_loader("val")
        self.val_loader = val_loader
        check_eval_inputs(cfg)
        check_wandb_login(cfg)  # wandb.init comes after the run folder is made
        self.init_source = check_init_from(cfg)  # what init_from names, read once (memlm.hf.source)
        if self.env.is_main:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
        # One run per dump_dir, taken before anything in it is written, cleaned or resumed.
        self.run_lock = lock_run_dir(self.dump_dir, self.env.is_main, self.env.distributed, self.env.device)
        self.model = self._build_model()
        self.params = split_params(self.model)  # (dense, sparse tables): clipped apart (memlm.memory.tables)
        self.value_grads = memory_hooks.value_grad_reduction(self.model, self.meshes, self.env, self.accum, cfg)
        self.optimizer = build_optimizer(self.model, cfg, self.env.device)
        # What the fine-tune mode does between backward and step (sparse: the rows that may change)
        self.finetune = mode_of(cfg).step_hook(self.model, cfg, self.env.distributed, self.init_source)
        if (line := self.finetune.describe()) is not None:  # sparse: the background file it ranks against
            self._print_main(f"[train] {line}")
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.step = 0
        self.tokens = 0
        # Per-step loss, norms and the skip flag stay on the device until a read.
        self.guard = StepGuard(cfg.max_nonfinite_steps, self._print_main, lower=lower_hint(mode_of(cfg), cfg))
        self.checkpointer = Checkpointer(self.dump_dir, cfg.checkpoint)
        self.evaluation = Evaluation(cfg, self.env, self.model, self._autocast)
        self.checkpointer.recover()  # finish or undo a save a kill interrupted, before choosing one
        self.resumed_from = self._restore()
        # A finished run's command run again (resumed at steps or later) trains nothing and writes
        # nothing: its folder keeps describing the run that happened (study reports read config.yaml).
        self.nothing_to_train = self.resumed_from is not None and self.step >= cfg.steps
        if self.nothing_to_train:
            self._print_settings_not_recorded()
        else:
            # Everything is checked and loaded: only now does this run write into its folder (a
            # command that failed above leaves an existing run's files as they were).
            if self.env.is_main:
                atomic_write_text(self.dump_dir / "config.yaml", to_yaml(cfg))
                keep_tokenizer(cfg, self.dump_dir)
            self.checkpointer.start_lineage(self.step)  # later checkpoints belong to an abandoned history

    def _restore(self):
        """resume: everything (model, optimizer, schedule, counters, data, RNG);
        init_from: weights only (a memlm checkpoint; an export or hf:<dir>, a Hugging Face Llama:
        hf/importer.py),
        for a run with no checkpoint of its own (with resume=auto, one in dump_dir wins)."""
        cfg = self.cfg
        path = self.checkpointer.resolve(cfg.resume)
        if path is None and cfg.init_from:
            if cfg.resume == "auto" and self.env.is_main:
                print(f"[train] resume=auto: no checkpoint in {self.checkpointer.root}, starting from "
                      f"init_from={cfg.init_from}", flush=True)
            source = self.init_source
            if source.kind != "checkpoint":
                import_init(cfg, source, self.model, getattr(self.train_loader, "tokenizer", None),
                            self._print_main)
            else:
                self.checkpointer.load_weights(source.directory, self.model, cfg.checkpoint.verify == "checksum",
                                               fresh=mode_of(cfg).fresh_on_init, meta=source.checked)
                if self.env.is_main:
                    print(f"[train] initialized weights from {source.directory}", flush=True)
            return None
        if path is None:
            if cfg.resume == "auto" and self.env.is_main:
                print(f"[train] resume=auto: no checkpoint in {self.checkpointer.root}, starting fresh", flush=True)
            return None
        if cfg.init_from and self.env.is_main:
            print(f"[train] resume=auto: {path} found, so init_from={cfg.init_from} is not loaded "
                  "(it starts runs without a checkpoint)", flush=True)
        meta = self.checkpointer.load(path, self._training_state())
        self.step, self.tokens = meta["step"], meta["tokens"]
        self.nonfinite_total = meta.get("nonfinite_total", 0)
        if self.env.is_main:
            print(f"[train] resumed from {path} at step {self.step}", flush=True)
            if self.step >= cfg.steps:
                print(f"[train] the run already reached steps={cfg.steps}: nothing to train (a larger steps= "
                      "trains it further; resume=none starts it over)", flush=True)
        return path

    def _print_settings_not_recorded(self) -> None:
        """Nothing to train: name the settings of this command that the run's config.yaml
        (left as it was) does not hold, on one line."""
        path = self.dump_dir / "config.yaml"
        if not self.env.is_main or not path.is_file():
            return

        def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
            if not isinstance(tree, dict) or not tree:
                return {prefix[:-1]: tree}
            return {k: v for key, value in tree.items() for k, v in flat(value, f"{prefix}{key}.").items()}

        recorded = flat(OmegaConf.to_container(OmegaConf.create(path.read_text())))
        ours = flat(OmegaConf.to_container(OmegaConf.create(to_yaml(self.cfg))))
        differ = sorted(key for key in recorded.keys() | ours.keys() if recorded.get(key) != ours.get(key))
        if differ:
            print(f"[train] {path} is left as it was, so this command's settings that differ from it are "
                  f"not recorded: {', '.join(differ)}", flush=True)

    @property
    def nonfinite_total(self) -> int:
        """Steps skipped for a non-finite loss or gradient norm, as of the last host read."""
        return self.guard.nonfinite_total

    @nonfinite_total.setter
    def nonfinite_total(self, value: int) -> None:
        self.guard.nonfinite_total = value

    def _print_main(self, line: str) -> None:
        if self.env.is_main:
            print(line, flush=True)

    def save_checkpoint(self) -> Path:
        """Save now (a preemption, a test); the loop's saves are the checkpointer's to time."""
        return self.checkpointer.save(self.step, self._training_state())

    def _training_state(self) -> TrainingState:
        self.guard.read(report=False)  # skip count and stop rule up to date before anything is written
        return TrainingState(self.model, self.optimizer, self.scheduler, self.train_loader,
                             {"tokens": self.tokens, "nonfinite_total": self.nonfinite_total}, to_yaml(self.cfg))

    # ------------------------------------------------------------ building
    def _build_model(self) -> Transformer:
        cfg, env = self.cfg, self.env
        seed_everything(cfg.seed)
        if cfg.parallel.init == "full":
            model = Transformer(cfg.model, cfg.memory)  # on CPU, identical on every rank
            model.init_weights()
        else:
            with torch.device("meta"):
                model = Transformer(cfg.model, cfg.memory)
        mode = mode_of(cfg)
        mode.adapt(model, cfg)  # lora's adapters
        mode.freeze(model)  # before sharding: frozen parameters get no gradient or state
        memory_hooks.shard_memory_values(model, self.meshes, env)
        apply_activation_checkpointing(model, cfg.parallel.activation_checkpoint)
        if cfg.parallel.compile:
            apply_compile(model)
        apply_fsdp(model, self.meshes, cfg.parallel, env.device)
        if cfg.parallel.init == "full":
            model.to(env.device)
        else:
            model.to_empty(device=env.device)
            # One stream per shard, shared by its replicas (hybrid: across nodes); on
            # CUDA, DTensor's RNG tracker does the same from rank 0's state.
            seed_everything(cfg.seed + shard_index(self.meshes, env))
            model.init_weights()
            reset_lora(model)
        # Value tables from the seed alone: replicas agree, init=full == init=sharded.
        memory_hooks.init_value_tables(model, cfg.seed)
        return model

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
        memory_hooks.on_step_start(self.model, self.step, self.cfg)
        self.finetune.start_step()
        loss_sum = torch.zeros((), device=self.env.device)
        for micro in range(self.accum):
            inputs, targets, doc_ids = model_batch(next(self.train_loader), self.env.device, self.cfg.model.doc_mask)
            sync = micro == self.accum - 1
            if hasattr(self.model, "set_requires_gradient_sync"):
                self.model.set_requires_gradient_sync(sync)
            loss = self._forward_loss(inputs, targets, doc_ids) / self.accum
            loss.backward()
            loss_sum += loss.detach()
        self.value_grads.finish()  # started by a hook during the last backward
        self.finetune.after_backward()  # finetune=sparse: only the selected rows keep a gradient
        if self.env.distributed:
            dist.all_reduce(loss_sum)  # every rank must agree on skipping: the global loss decides
            loss_sum /= self.env.world_size
        self.tokens += self.accum * self.cfg.data.micro_batch * self.cfg.data.seq_len * self.env.world_size
        lr = self.scheduler.get_last_lr()[0]
        dense, tables = self.params
        gnorm = clip_group_(dense, self.cfg.optim.clip)
        # The tables' clip is applied by the optimizer's step, as it reads their gradients.
        vnorm = clip_in_step_(self.optimizer, tables, self.cfg.memory.value_grad_clip) if tables \
            else torch.zeros_like(gnorm)
        ok = step_ok(loss_sum, gnorm, vnorm)  # norms are global: every rank gets the same flag
        step_if_finite(self.optimizer, ok)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()  # a skipped step is consumed (its data and schedule slot) like any other
        self.step += 1
        self.guard.record(self.step, lr, loss_sum, gnorm, vnorm, ok)
        return self.guard.read() if read else {}

    def validate(self) -> float | None:
        if self.val_loader is None or self.cfg.val_batches == 0:
            return None
        self.model.eval()
        total = torch.zeros((), device=self.env.device)
        for _ in range(self.cfg.val_batches):
            inputs, targets, doc_ids = model_batch(next(self.val_loader), self.env.device, self.cfg.model.doc_mask)
            with self._autocast():
                logits = self.model(inputs, doc_ids=doc_ids)
            total += chunked_cross_entropy(logits, targets)
        if self.env.distributed:
            dist.all_reduce(total)
            total /= self.env.world_size
        self.model.train()
        reshard(self.model)
        return total.item() / self.cfg.val_batches

    # ---------------------------------------------------------------- loop
    def fit(self, stop_after: int | None = None) -> dict[str, Any]:
        """Train until `cfg.steps` (or `stop_after` steps, e.g. a time slot
        before a requeue: the schedule still spans cfg.steps). The run's lock
        on dump_dir is held until everything, summary.json included, is written.
        A run with nothing to train writes nothing (the summary is the one recorded)."""
        try:
            return self._recorded_summary() if self.nothing_to_train else self._fit(stop_after)
        finally:
            self.close()

    def _fit(self, stop_after: int | None) -> dict[str, Any]:
        cfg, env = self.cfg, self.env
        last_step = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        logger = MetricsLogger(self.dump_dir, env.is_main, cfg.name,
                               OmegaConf.to_container(OmegaConf.structured(cfg)), cfg.logging.wandb,
                               cfg.logging.tensorboard, start_step=self.step)
        profiler = StepProfiler(cfg.profile.steps, self.dump_dir, env.device, env.rank)
        counts = self._unwrapped().num_params()
        if env.is_main:
            print(f"[train] {cfg.name}: {counts['total']:,} params ({counts['active']:,} active), "
                  f"{env.world_size} rank(s) on {env.device.type}, accumulation {self.accum}, "
                  f"{cfg.steps} steps -> {self.dump_dir}", flush=True)
        progress = Progress(cfg, env, self._unwrapped(), self.step, self.tokens)
        usage = UsageRecorder(self.model, cfg.steps, cfg.checkpoint.slot_usage_steps,
                              self.accum * cfg.data.micro_batch * cfg.data.seq_len * env.world_size, env.distributed)
        first_step, metrics, val_loss, evals, preempted = self.step, {}, None, {}, False
        usage_dir = None  # where the last steps' slot usage goes: beside the final checkpoint
        # SIGUSR1 or SIGTERM (Slurm: before the time limit, preemption) -> checkpoint after the current step and stop.
        preemption = install_preemption_handler(
            lambda: self.save_checkpoint() if self.checkpointer.saved_step != self.step else None)
        try:
            while self.step < last_step:
                # Device values reach the host only at logging steps (and in
                # saves, evaluations and validation): the other steps never wait.
                logging_step = (self.step + 1) % cfg.logging.every == 0 or self.step + 1 == last_step
                profiler.before_step(self.step + 1)
                usage.before_step(self.step)
                metrics = self.train_step(read=logging_step) or metrics
                usage.after_step(self.step - 1)
                profiler.after_step(self.step)
                if logging_step:
                    logger.log(*progress.report(self.step, self.tokens, metrics, self.nonfinite_total, self.model))
                if cfg.val_every and self.step % cfg.val_every == 0 and self.step < cfg.steps:
                    val_loss = self._log_validation(logger)
                saved = self.checkpointer.maybe_save(self.step, self._training_state)
                if self.evaluation.due(self.step):
                    evals = self.evaluation.run(self.step, logger, saved)
                # Collective on several ranks, so only at logging steps (every rank
                # reaches the same ones, so every rank stops after the same step);
                # logging.every bounds how late a signal is seen.
                if (logging_step or not env.distributed) and preemption.check():
                    preempted = True
                    break
            if preempted:
                metrics = self.guard.read() or metrics  # steps since the last logging step (one process)
            elif self.step > first_step:  # a finished run resumed has done all of this already
                if self.val_loader is not None:
                    val_loss = self._log_validation(logger)
                saved = self.checkpointer.maybe_save(self.step, self._training_state, last=True)
                usage_dir = saved or self.dump_dir
                if self.evaluation.due(self.step, last=True):
                    evals = self.evaluation.run(self.step, logger, saved)
        finally:
            preemption.uninstall()
            profiler.close()
            self.checkpointer.finalize()  # a background save lands before the summary says the run ended
            logger.close()
        if usage_dir is not None and (written := usage.write(usage_dir, env.is_main)) is not None:
            print(f"[train] slot usage of the last {usage.tokens:,} tokens -> {written}", flush=True)
        return self._finish(progress.elapsed(), metrics, val_loss, evals, preempted)

    def close(self) -> None:
        """Give the dump_dir back (the run lock); fit() does it when it ends."""
        if self.run_lock is not None:
            self.run_lock.release()

    def _recorded_summary(self) -> dict[str, Any]:
        """fit() with nothing to train: the run's summary.json as it is (if it is this step's)."""
        summary = run_summary(name=self.cfg.name, steps=self.step, tokens=self.tokens, metrics={}, val_loss=None,
                              evals={}, nonfinite_skipped=self.nonfinite_total, preempted=False, seconds=0.0,
                              dump_dir=self.dump_dir)
        if self.env.is_main:
            try:
                recorded = json.loads((self.dump_dir / "summary.json").read_text())
            except (OSError, ValueError):
                recorded = None
            if isinstance(recorded, dict) and recorded.get("steps") == self.step:
                summary = recorded
            print(summary_line(summary), flush=True)
        return summary

    def _finish(self, seconds: float, last: dict, val_loss, eval_results: dict, preempted: bool = False) -> dict:
        summary = run_summary(name=self.cfg.name, steps=self.step, tokens=self.tokens, metrics=last,
                              val_loss=val_loss, evals=eval_results, nonfinite_skipped=self.nonfinite_total,
                              preempted=preempted, seconds=seconds, dump_dir=self.dump_dir)
        if self.env.is_main:
            # nothing trained (a requeue of a finished run): keep the results already reported
            summary = write_summary(self.dump_dir, summary, trained=bool(last))
            print(summary_line(summary), flush=True)
        return summary

    def _log_validation(self, logger: MetricsLogger) -> float | None:
        val = self.validate()
        if val is not None:
            logger.log({"step": self.step, "val_loss": val}, f"[train] step {self.step}  val_loss {val:.4f}")
        return val

    def _unwrapped(self) -> Transformer:
        return self.model
