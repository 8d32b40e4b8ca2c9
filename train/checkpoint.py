"""Sharded, atomic checkpoints with torch.distributed.checkpoint (DCP).

Layout of `dump_dir/checkpoints/`:

    step_00000600/            one complete checkpoint
        .metadata, __*.distcp   DCP shards: model weights and optimizer tensors
        rank{r}.json          per-rank state: data loader, RNG states
        meta.json             step, tokens, scheduler, optimizer hyper-parameters,
                              world size, config, and the manifest (every file's
                              size and crc32); written last: its presence marks
                              the checkpoint complete
    .tmp_step_00000700/       a save in progress (ignored, removed on the next save)
    latest                    name of the newest complete checkpoint

A save writes into `.tmp_<name>`, then renames it, then rewrites `latest`
(each an atomic rename), so a crash at any moment leaves the previous
checkpoint usable. Loading checks the manifest before DCP reads anything.
No load path unpickles tensor data: DCP loads tensors with weights_only, and
every non-tensor value is JSON.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from memlm.train.config import CheckpointConfig
from memlm.train.finite import check_finite_state

PREFIX = "step_"


class CheckpointError(RuntimeError):
    pass


def _dcp(fn, *args, **kwargs):
    """DCP save/load; one process runs without a process group (no warning).
    DCP's CheckpointException derives from BaseException: it becomes a
    CheckpointError naming the checkpoint and the first rank's error."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            return fn(*args, no_dist=not dist.is_initialized(), **kwargs)
        except CheckpointException as err:
            first = next(iter(err.failures.values()), err)
            first = getattr(first, "exc", first)
            raise CheckpointError(f"checkpoint {kwargs.get('checkpoint_id')}: {type(first).__name__}: "
                                  f"{str(first).splitlines()[0] if str(first) else ''}") from None


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _manifest(directory: Path, with_checksum: bool) -> dict[str, dict[str, int]]:
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != "meta.json")
    return {p.name: {"size": p.stat().st_size, **({"crc32": _crc32(p)} if with_checksum else {})} for p in files}


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def verify(directory: Path, with_checksum: bool = True) -> dict[str, Any]:
    """Check a checkpoint against its manifest; return its meta. Raises
    CheckpointError naming the first missing, truncated or corrupted file."""
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{directory} is not a complete checkpoint: {meta_path} is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{meta_path} is unreadable: {err}") from None
    for name, expected in meta["manifest"].items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        if path.stat().st_size != expected["size"]:
            raise CheckpointError(f"checkpoint file {path} has {path.stat().st_size} bytes, expected {expected['size']} (truncated?)")
        if with_checksum and "crc32" in expected and _crc32(path) != expected["crc32"]:
            raise CheckpointError(f"checkpoint file {path} is corrupted (crc32 mismatch)")
    return meta


def complete_checkpoints(root: Path) -> list[Path]:
    """Directories that look complete (meta.json present), newest step first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


def check_shapes(directory: Path, model_state: dict[str, Any]) -> None:
    """Fail with every mismatched tensor listed, before DCP touches the model."""
    saved = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    problems = []
    for key, value in model_state.items():
        fqn = f"model.{key}"
        if fqn not in saved:
            problems.append(f"{key}: missing from the checkpoint")
        elif hasattr(saved[fqn], "size") and tuple(saved[fqn].size) != tuple(value.shape):
            problems.append(f"{key}: checkpoint {tuple(saved[fqn].size)} vs model {tuple(value.shape)}")
    extra = sorted(k[len("model."):] for k in saved if k.startswith("model.") and k[len("model."):] not in model_state)
    problems += [f"{k}: in the checkpoint but not in the model" for k in extra]
    if problems:
        raise CheckpointError(
            f"checkpoint {directory} does not match the model ({len(problems)} tensors):\n  " + "\n  ".join(problems)
        )


class Checkpointer:
    def __init__(self, dump_dir: Path, cfg: CheckpointConfig):
        self.root = Path(dump_dir) / "checkpoints"
        self.cfg = cfg
        self._pending = None  # an async save in flight: (future, tmp, final, meta, start)

    # ---------------------------------------------------------------- save
    def save(self, step: int, model, optimizer, scheduler, loader, trainer_state: dict[str, Any],
             config_yaml: str) -> Path:
        """Write a checkpoint of the current state. With `checkpoint.async_save`
        the tensors are staged in host memory and written in the background;
        the checkpoint becomes visible (renamed, `latest`) when the next save
        starts or `finalize()` is called."""
        self.finalize()  # one save in flight at most
        # Before anything is written: a NaN/inf weight or moment is never saved.
        check_finite_state(model, optimizer, f"checkpoint of step {step}", CheckpointError)
        start = time.perf_counter()
        name = f"{PREFIX}{step:08d}"
        tmp, final = self.root / f".tmp_{name}", self.root / name
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            # Saves never overlap, so any temporary directory left is from a
            # save that was interrupted: it is incomplete by construction.
            for stale in self.root.glob(".tmp_*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        osd = get_optimizer_state_dict(model, optimizer)
        state = {"model": get_model_state_dict(model), "optim": {"state": osd["state"]}}
        loader_state = loader.state_dict() if hasattr(loader, "state_dict") else None
        _atomic_write(tmp / f"rank{_rank()}.json", json.dumps({"loader": loader_state, "rng": rng_state()}))
        meta = {"step": step, "world_size": _world(), **trainer_state, "scheduler": scheduler.state_dict(),
                "param_groups": osd["param_groups"], "config": config_yaml}
        if self.cfg.async_save:
            future = _dcp(dcp.async_save, state, checkpoint_id=str(tmp))
            self._pending = (future, tmp, final, meta, start)
            if _rank() == 0:
                print(f"[checkpoint] staged step {step} for a background write (training blocked "
                      f"{time.perf_counter() - start:.2f}s)", flush=True)
            return final
        _dcp(dcp.save, state, checkpoint_id=str(tmp))
        self._publish(tmp, final, meta, start)
        return final

    def finalize(self) -> None:
        """Wait for a background save (if any) and make it the newest checkpoint."""
        pending, self._pending = self._pending, None
        if pending is not None:
            future, tmp, final, meta, start = pending
            result = future.result() if hasattr(future, "result") else future.upload_completion.result()
            del result
            self._publish(tmp, final, meta, start)

    def _publish(self, tmp: Path, final: Path, meta: dict[str, Any], start: float) -> None:
        """Every rank has written into tmp: add the manifest, rename, point `latest` at it."""
        _barrier()
        if _rank() == 0:
            meta = {**meta, "manifest": _manifest(tmp, self.cfg.verify == "checksum")}
            _atomic_write(tmp / "meta.json", json.dumps(meta))
            if final.exists():  # re-saving a step (e.g. after a resume): keep the old one until replaced
                old = self.root / f".old_{final.name}"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _atomic_write(self.root / "latest", final.name + "\n")
            self._prune()
            size = sum(p.stat().st_size for p in final.iterdir())
            verb = "wrote in the background" if self.cfg.async_save else "saved"
            print(f"[checkpoint] {verb} {final} ({size / 2**20:.1f} MiB, "
                  f"{'since staging' if self.cfg.async_save else 'training blocked'} "
                  f"{time.perf_counter() - start:.2f}s)", flush=True)
        _barrier()

    def _prune(self) -> None:
        kept = complete_checkpoints(self.root)
        for i, path in enumerate(kept):
            step = int(path.name[len(PREFIX):])
            if i < self.cfg.keep or (self.cfg.keep_every and step % self.cfg.keep_every == 0):
                continue
            shutil.rmtree(path, ignore_errors=True)

    # ---------------------------------------------------------------- load
    def resolve(self, resume: str) -> Path | None:
        """The checkpoint to resume from: `auto` -> newest one that verifies
        (broken ones are skipped with a warning naming them), else the path."""
        if resume == "none":
            return None
        if resume != "auto":
            path = Path(resume)
            verify(path, self.cfg.verify == "checksum")
            return path
        for path in complete_checkpoints(self.root):
            try:
                verify(path, self.cfg.verify == "checksum")
                return path
            except CheckpointError as err:
                if _rank() == 0:
                    print(f"[checkpoint] warning: skipping {path}: {err}", flush=True)
        return None

    def load(self, path: Path, model, optimizer, scheduler, loader) -> dict[str, Any]:
        """Restore everything saved; returns meta (step, tokens, ...)."""
        meta = json.loads((path / "meta.json").read_text())
        model_state = get_model_state_dict(model)
        check_shapes(path, model_state)
        osd = get_optimizer_state_dict(model, optimizer)
        state = {"model": model_state, "optim": {"state": osd["state"]}}
        _dcp(dcp.load, state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, {"state": state["optim"]["state"],
                                                    "param_groups": meta["param_groups"]})
        scheduler.load_state_dict(meta["scheduler"])
        rank_file = path / f"rank{_rank()}.json"
        if meta["world_size"] == _world() and rank_file.is_file():
            per_rank = json.loads(rank_file.read_text())
            if loader is not None and per_rank["loader"] is not None and hasattr(loader, "load_state_dict"):
                loader.load_state_dict(per_rank["loader"])
            set_rng_state(per_rank["rng"])
        elif loader is not None and hasattr(loader, "reshard_state_dict"):
            states = [json.loads((path / f"rank{r}.json").read_text())["loader"] for r in range(meta["world_size"])]
            loader.reshard_state_dict(states)
        elif _rank() == 0:
            print(f"[checkpoint] world size changed ({meta['world_size']} -> {_world()}): model and optimizer "
                  "were resharded; the data stream restarts from its beginning", flush=True)
        return meta

    @staticmethod
    def load_weights(path: Path, model, with_checksum: bool = True) -> dict[str, Any]:
        """init_from: the model weights only."""
        meta = verify(Path(path), with_checksum)
        model_state = get_model_state_dict(model)
        check_shapes(Path(path), model_state)
        state = {"model": model_state}
        _dcp(dcp.load, state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
        return meta
