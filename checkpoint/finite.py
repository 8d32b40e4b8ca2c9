"""Refuse to write non-finite tensors: the check every checkpoint save and export makes first.

    check_finite_state(model, optimizer, "checkpoint of step 40", CheckpointError)   # all ranks
    check_finite(state_dict, "export of step_00000040", ExportError)                   # one process

A NaN or inf that reached the weights or AdamW's moments must never be
saved: a later resume or export would carry it on silently. The check runs
before anything is written and raises `error` naming up to `MAX_NAMED`
tensors with their counts of non-finite values (summed over every rank's
shard; a replicated tensor counts once per rank holding it). Under torch.distributed each
rank checks its own shards; one small all-reduce makes every rank raise
together (a rank that went on into the save's collectives would hang), and
only then are the names gathered.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from memlm.ranks import collective_device, group_size, many_ranks

MAX_NAMED = 10


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def nonfinite_counts(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """{name: number of non-finite values} of the floating-point tensors that
    have any (this process's shards of DTensors). One host read for all."""
    names, counts = [], []
    for name, t in tensors:
        t = _local(t)
        if t.is_floating_point() or t.is_complex():
            if t.is_sparse:
                t = t.coalesce().values()
            names.append(name)
            counts.append((~torch.isfinite(t.detach())).sum())
    if not names:
        return {}
    values = torch.stack([c.to(counts[0].device) for c in counts]).tolist()
    return {n: int(c) for n, c in zip(names, values) if c}


def model_and_optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                                ) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) of the model's state dict and the optimizer's per-parameter
    state, named `optim.<param>.<key>`."""
    yield from model.state_dict().items()
    if optimizer is None:
        return
    for name, p in model.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            if torch.is_tensor(value):
                yield f"optim.{name}.{key}", value


def _describe(what: str, counts: Mapping[str, int]) -> str:
    named = sorted(counts.items())
    shown = ", ".join(f"{n} ({c} non-finite)" for n, c in named[:MAX_NAMED])
    more = f", and {len(named) - MAX_NAMED} more" if len(named) > MAX_NAMED else ""
    return (f"refusing to write the {what}: {len(named)} tensor(s) hold NaN or inf values: {shown}{more}. "
            "Nothing was written.")


def check_finite(state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], what: str,
                 error: type[Exception]) -> None:
    """Raise `error` naming the non-finite tensors of `state` (this process only)."""
    items = state.items() if isinstance(state, Mapping) else state
    counts = nonfinite_counts(items)
    if counts:
        raise error(_describe(what, counts))


def check_finite_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, what: str,
                       error: type[Exception]) -> None:
    """check_finite over the model and optimizer state on every rank of the
    default process group: all ranks raise, or none."""
    counts = nonfinite_counts(model_and_optimizer_tensors(model, optimizer))
    if many_ranks():
        flag = torch.tensor([len(counts)], dtype=torch.int64, device=collective_device())
        dist.all_reduce(flag)
        if int(flag.item()) == 0:
            return
        everyone: list[dict[str, int] | None] = [None] * group_size()
        dist.all_gather_object(everyone, counts)
        counts = {}
        for part in everyone:
            for name, c in (part or {}).items():
                counts[name] = counts.get(name, 0) + c
    if counts:
        raise error(_describe(what, counts))
