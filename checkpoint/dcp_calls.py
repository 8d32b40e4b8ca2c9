"""DCP's calls as the checkpointer makes them, and the rank agreement around them.

    dcp_call(dcp.save, state, checkpoint_id=str(tmp))   # one process: no group needed; a failure: CheckpointError
    check_shapes(path, model_state)                     # every mismatched tensor named, before DCP reads
    entries = gather_to_main(part)                      # rank 0: every rank's part; others: their own
    error = agreed_error(mine)                          # every rank: the first rank's error, or None

memlm.checkpoint.checkpointer uses these; they hold no checkpointer state.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from memlm.checkpoint.folder import CheckpointError
from memlm.ranks import group_rank, group_size


def dcp_call(fn, *args, **kwargs):
    """DCP save/load; one process runs without a process group (no warning).
    DCP's CheckpointException derives from BaseException: it becomes a
    CheckpointError naming the checkpoint and the first rank's error."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            return fn(*args, no_dist=not dist.is_initialized(), **kwargs)
        except CheckpointException as err:
            raise checkpoint_error(err, kwargs.get("checkpoint_id")) from None


def check_async_backend() -> None:
    """dcp.async_save runs its collectives on host tensors: a process group
    without a CPU backend (e.g. NCCL alone, made outside memlm's trainer) is
    named in one clear error before anything is written, instead of DCP's assertion."""
    if dist.is_initialized():
        types = sorted(d.type for d in dist.distributed_c10d._get_default_group()._device_types)
        if "cpu" not in types:
            raise CheckpointError(
                f"checkpoint.async_save=true needs a CPU backend in the default process group, which has one "
                f"for {', '.join(types)} only: initialize it with backend='cpu:gloo,cuda:nccl' (memlm's trainer "
                f"does, memlm.distributed.env.process_group_backend), or set checkpoint.async_save=false")


def checkpoint_error(err: CheckpointException, checkpoint_id) -> CheckpointError:
    """failures: {rank: (exception, traceback summary)}: name the first rank's exception."""
    first = next(iter(err.failures.values()), err)
    if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
        first = first[0]
    return CheckpointError(f"checkpoint {checkpoint_id}: {type(first).__name__}: "
                           f"{str(first).splitlines()[0] if str(first) else ''}")


def gather_to_main(part: dict[str, Any]) -> dict[str, Any]:
    """Rank 0: the union of every rank's `part`; other ranks: their own."""
    if not dist.is_initialized():
        return part
    parts: list[Any] = [None] * group_size() if group_rank() == 0 else None
    dist.gather_object(part, parts, dst=0)
    return {k: v for p in parts for k, v in p.items()} if group_rank() == 0 else part


def agreed_error(error: str | None) -> str | None:
    """The first rank's error (by rank), known to every rank, or None when all passed."""
    if not dist.is_initialized():
        return error
    errors: list[Any] = [None] * group_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


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
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise CheckpointError(
            f"checkpoint {directory} does not match this run's model ({len(problems)} tensor(s): {shown}): it was "
            f"saved with another model or memory config; resume it with that config (the run's config.yaml), "
            f"start over with resume=none, or choose another dump_dir"
        )
