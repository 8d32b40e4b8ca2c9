"""Sharded, atomic checkpoints with torch.distributed.checkpoint (DCP).

Layout of `dump_dir/checkpoints/`:

    step_00000600/            one complete checkpoint
        .metadata, __*.distcp   DCP shards: model weights and optimizer tensors
        rank{r}.json          per-rank state: the training and validation streams' positions, RNG states
        meta.json             step, tokens, scheduler, optimizer hyper-parameters,
                              world size, config, the manifest (every file's
                              size and crc32) and its own crc32; written last:
                              its presence marks the checkpoint complete
    .tmp_step_00000700/       a save in progress (ignored, removed on the next start or save)
    abandoned_<time>/         later checkpoints a rollback or fresh start left behind
    latest                    name of the newest complete checkpoint

A save writes into `.tmp_<name>`, then renames it, then rewrites `latest`
(each an atomic rename), so a crash at any moment leaves the previous
checkpoint usable; `recover()` finishes or undoes an interrupted re-save.
The names and integrity rules live in memlm.checkpoint.folder. Loading
checks the manifest before DCP reads anything. No load path unpickles tensor
data: DCP loads tensors with weights_only, and every non-tensor value is JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from memlm.checkpoint.config import CheckpointConfig
from memlm.checkpoint.dcp_calls import (
    agreed_error,
    check_async_backend,
    check_shapes,
    checkpoint_error,
    dcp_call,
    gather_to_main,
)
from memlm.checkpoint.finite import check_finite_state
from memlm.checkpoint.folder import (
    OLD,
    PREFIX,
    TMP,
    CheckpointError,
    abandon_later,
    checkpoint_dirs,
    complete_checkpoints,
    manifest,
    misnamed_dirs,
    read_meta,
    recover,
    seal_meta,
    step_of,
    verify,
    write_latest,
)
from memlm.checkpoint.rng import rng_state, set_rng_state
from memlm.files import atomic_write_text
from memlm.ranks import group_barrier, group_rank, group_size

__all__ = ["CheckpointError", "Checkpointer", "check_shapes", "complete_checkpoints", "verify"]


@dataclass
class TrainingState:
    """What a checkpoint holds, named once by its owner (the trainer): saved by
    `Checkpointer.save`, restored in place by `Checkpointer.load`."""

    model: Any
    optimizer: Any
    scheduler: Any
    loader: Any = None  # its state_dict per rank, when it has one
    counters: dict[str, Any] = field(default_factory=dict)  # into meta.json: tokens, nonfinite_total
    config_yaml: str = ""
    val_loader: Any = None  # the validation stream, saved like the training one

    def loaders(self) -> dict[str, Any]:
        """{key in rank{r}.json: stream}: the streams a checkpoint records the position of (STREAMS)."""
        return {"loader": self.loader, "val_loader": self.val_loader}


# The streams' keys in rank{r}.json, and what a message calls them.
STREAMS = {"loader": "training", "val_loader": "validation"}


class Checkpointer:
    """Saves on its own schedule (`maybe_save`), publishes atomically, restores.

        checkpointer = Checkpointer(dump_dir, cfg.checkpoint)
        saved = checkpointer.maybe_save(step, lambda: state)          # every checkpoint.every steps
        saved = checkpointer.maybe_save(step, lambda: state, last=True)  # and at the end (checkpoint.at_end)
        checkpointer.finalize()                                        # a background save has landed
    """

    def __init__(self, dump_dir: Path, cfg: CheckpointConfig):
        self.root = Path(dump_dir) / "checkpoints"
        self.cfg = cfg
        self.saved_step: int | None = None  # the step the newest checkpoint of this run holds
        self._pending = None  # an async save in flight: (future, tmp, final, meta, start)

    def path(self, step: int) -> Path:
        return self.root / f"{PREFIX}{step:08d}"

    # ---------------------------------------------------------------- save
    def maybe_save(self, step: int, state: Callable[[], TrainingState], *, last: bool = False) -> Path | None:
        """Save if the schedule asks for this step: every `checkpoint.every`
        steps, and at the end of a run or time slot (`last`) with
        `checkpoint.at_end`. A step already saved (a preemption's save, or the
        checkpoint a run resumed from) is not written again. `state` is called
        only when a save happens. Returns the step's checkpoint, or None."""
        due = bool(self.cfg.every and step % self.cfg.every == 0) or (last and self.cfg.at_end)
        if not due:
            return None
        return self.path(step) if step == self.saved_step else self.save(step, state())

    def save(self, step: int, state: TrainingState) -> Path:
        """Write a checkpoint of the current state. With `checkpoint.async_save`
        the tensors are staged in host memory and written in the background;
        the checkpoint becomes visible (renamed, `latest`) when the next save
        starts or `finalize()` is called."""
        model, optimizer = state.model, state.optimizer
        self.finalize()  # one save in flight at most
        if self.cfg.async_save:
            check_async_backend()
        # Before anything is written: a NaN/inf weight or moment is never saved.
        check_finite_state(model, optimizer, f"checkpoint of step {step}", CheckpointError)
        start = time.perf_counter()
        final = self.path(step)
        tmp = self.root / f"{TMP}{final.name}"
        if group_rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            # Saves never overlap, so any temporary directory left is from a
            # save that was interrupted: it is incomplete by construction.
            for stale in self.root.glob(f"{TMP}*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        group_barrier()
        osd = get_optimizer_state_dict(model, optimizer)
        tensors = {"model": get_model_state_dict(model), "optim": {"state": osd["state"]}}
        positions = {key: loader.state_dict() if hasattr(loader, "state_dict") else None
                     for key, loader in state.loaders().items()}
        atomic_write_text(tmp / f"rank{group_rank()}.json", json.dumps({**positions, "rng": rng_state()}))
        meta = {"step": step, "world_size": group_size(), **state.counters, "scheduler": state.scheduler.state_dict(),
                "param_groups": osd["param_groups"], "config": state.config_yaml}
        if self.cfg.async_save:
            future = dcp_call(dcp.async_save, tensors, checkpoint_id=str(tmp))
            self._pending = (future, tmp, final, meta, start)
            self.saved_step = step
            if group_rank() == 0:
                print(f"[checkpoint] staged step {step} for a background write (training blocked "
                      f"{time.perf_counter() - start:.2f}s)", flush=True)
            return final
        dcp_call(dcp.save, tensors, checkpoint_id=str(tmp))
        self._publish(tmp, final, meta, start)
        self.saved_step = step
        return final

    def finalize(self) -> None:
        """Wait for a background save (if any) and make it the newest checkpoint."""
        pending, self._pending = self._pending, None
        if pending is not None:
            future, tmp, final, meta, start = pending
            try:
                result = future.result() if hasattr(future, "result") else future.upload_completion.result()
            except CheckpointException as err:  # a BaseException: make it an ordinary, readable error
                raise checkpoint_error(err, tmp) from None
            del result
            self._publish(tmp, final, meta, start)

    def _publish(self, tmp: Path, final: Path, meta: dict[str, Any], start: float) -> None:
        """Every rank has written into tmp: add the manifest, rename, point `latest` at it.
        Each rank hashes its share of the files (about 1/world of the bytes), so
        no rank reads the whole checkpoint while the others wait in a collective."""
        group_barrier()
        entries = gather_to_main(manifest(tmp, self.cfg.verify == "checksum", group_rank(), group_size()))
        if group_rank() == 0:
            meta = seal_meta({**meta, "manifest": dict(sorted(entries.items()))})
            atomic_write_text(tmp / "meta.json", json.dumps(meta))
            if final.exists():  # re-saving a step (e.g. after a resume): keep the old one until replaced
                # A kill between these two renames leaves `latest` naming a missing
                # folder for a moment: readers then load .old_/.tmp_ (same step) and
                # the next start's recover() finishes the swap (checkpoint_dir.py).
                old = self.root / f"{OLD}{final.name}"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            write_latest(self.root, final.name)
            self._prune(final)
            size = sum(p.stat().st_size for p in final.iterdir())
            verb = "wrote in the background" if self.cfg.async_save else "saved"
            print(f"[checkpoint] {verb} {final} ({size / 2**20:.1f} MiB, "
                  f"{'since staging' if self.cfg.async_save else 'training blocked'} "
                  f"{time.perf_counter() - start:.2f}s)", flush=True)
        group_barrier()

    def _prune(self, newest: Path) -> None:
        """Keep `newest` (just published: it passed every check at save) and
        the keep - 1 checkpoints before it, plus multiples of keep_every. Only
        older steps are candidates: later ones cannot be in this run's lineage
        (start_lineage moved them aside), and are never deleted here."""
        older = [p for p in complete_checkpoints(self.root) if step_of(p.name) < step_of(newest.name)]
        for i, path in enumerate(older, start=1):
            step = step_of(path.name)
            if i < self.cfg.keep or (self.cfg.keep_every and step % self.cfg.keep_every == 0):
                continue
            shutil.rmtree(path, ignore_errors=True)

    # ---------------------------------------------------------------- run start (rank 0 holds the run lock)
    def recover(self) -> None:
        """Before resolving: finish or undo a re-save a kill interrupted, drop
        interrupted saves, and make `latest` name a complete checkpoint."""
        group_barrier()
        if group_rank() == 0:
            for line in recover(self.root, self.cfg.verify == "checksum"):
                print(f"[checkpoint] recovered {self.root}: {line}", flush=True)
        group_barrier()

    def start_lineage(self, step: int) -> None:
        """The run continues from `step` (0: a fresh start): checkpoints of
        later steps belong to a history it abandoned (a rollback, or newer
        checkpoints that all failed their checks). They are moved aside, never
        resumed or pruned, and `latest` names a checkpoint of this lineage."""
        group_barrier()
        if group_rank() == 0 and self.root.is_dir():
            dest, names = abandon_later(self.root, step)
            if dest is not None:
                print(f"[checkpoint] this run continues from step {step}: moved the {len(names)} later "
                      f"checkpoint(s) of an abandoned history ({', '.join(names)}) to {dest}; "
                      "they will not be resumed", flush=True)
        group_barrier()

    # ---------------------------------------------------------------- load
    def resolve(self, resume: str) -> Path | None:
        """The checkpoint to resume from: `auto` -> newest one that verifies
        (broken ones are skipped with a warning naming them), else the path."""
        if resume == "none":
            return None
        if resume != "auto":
            path = Path(resume)
            if (error := self._verify_share(path)) is not None:
                raise CheckpointError(error)
            return path
        if group_rank() == 0:
            for path in misnamed_dirs(self.root):
                print(f"[checkpoint] warning: skipping {path}: not a checkpoint name ({PREFIX}<step>)", flush=True)
        for path in checkpoint_dirs(self.root):
            error = self._verify_share(path)
            if error is None:
                return path
            if group_rank() == 0:
                print(f"[checkpoint] warning: skipping {path}: {error}", flush=True)
        return None

    def _verify_share(self, path: Path) -> str | None:
        """Every rank checks its share of the files' checksums (checkpoint_dir.share),
        in parallel; all ranks learn the first failure (or None)."""
        try:
            verify(path, self.cfg.verify == "checksum", group_rank(), group_size())
            error = None
        except CheckpointError as err:
            error = str(err)
        return agreed_error(error)

    def load(self, path: Path, state: TrainingState) -> dict[str, Any]:
        """Restore everything saved into `state`, in place; returns meta (step, tokens, ...)."""
        model, optimizer, scheduler, loaders = state.model, state.optimizer, state.scheduler, state.loaders()
        meta = read_meta(path)
        model_state = get_model_state_dict(model)
        check_shapes(path, model_state)
        osd = get_optimizer_state_dict(model, optimizer)
        state = {"model": model_state, "optim": {"state": osd["state"]}}
        dcp_call(dcp.load, state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, {"state": state["optim"]["state"],
                                                    "param_groups": meta["param_groups"]})
        scheduler.load_state_dict(meta["scheduler"])
        rank_file = path / f"rank{group_rank()}.json"
        restarted = []  # the streams that start again from their beginning
        if meta["world_size"] == group_size() and rank_file.is_file():
            per_rank = json.loads(rank_file.read_text())
            for key, loader in loaders.items():
                if loader is None or not hasattr(loader, "load_state_dict"):
                    continue
                if per_rank.get(key) is None:  # e.g. a checkpoint from before the validation stream was saved
                    restarted.append(key)
                else:
                    loader.load_state_dict(per_rank[key])
            set_rng_state(per_rank["rng"])
        elif any(loader is not None for loader in loaders.values()):
            per_rank = [json.loads((path / f"rank{r}.json").read_text()) for r in range(meta["world_size"])]
            for key, loader in loaders.items():
                if loader is None:
                    continue
                states = [old.get(key) for old in per_rank]
                if hasattr(loader, "reshard_state_dict") and None not in states:
                    loader.reshard_state_dict(states)
                else:
                    restarted.append(key)
        if restarted and group_rank() == 0:
            streams = " and ".join(STREAMS[k] for k in restarted)
            print(f"[checkpoint] {path.name} (saved on {meta['world_size']} rank(s), loaded on {group_size()}) holds "
                  f"no position this run can use for its {streams} stream: it restarts from its beginning", flush=True)
        self.saved_step = meta["step"]
        return meta

    @staticmethod
    def load_weights(path: Path, model, with_checksum: bool = True,
                     fresh: Callable[[str], bool] | None = None, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """The model weights only (init_from, or loading a run's model). `fresh(key)`: tensors
        left as initialized (a fine-tune mode's own, e.g. lora's adapters: memlm.finetune.modes).
        `meta`: its meta.json, when the caller read it already (init_from: the preflight)."""
        meta = verify(Path(path), with_checksum, meta=meta)
        whole = get_model_state_dict(model)
        model_state = {k: v for k, v in whole.items() if fresh is None or not fresh(k)}
        check_shapes(Path(path), model_state)
        state = {"model": model_state}
        dcp_call(dcp.load, state, checkpoint_id=str(path))
        # Not strict only for the fresh tensors left out above.
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=len(model_state) == len(whole)))
        return meta
