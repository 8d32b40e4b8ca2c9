"""knn schedule: move the training knn of every memory layer over the first steps.

"Dynamic sparsity" (docs/memory.md, "knn schedule"): knn at training and at
evaluation are separate (`knn`, `eval_knn`), and the training knn may follow a
schedule. memlm's schedule is linear from `memory.knn_schedule_start` to
`memory.knn` over `memory.knn_schedule_steps` steps, then constant; with
knn_schedule_start = 0 (default) there is no schedule.

The trainer calls, once per step before the forward pass:

    apply_knn_schedule(model, cfg.memory, step)

It is a pure function of `step`, so a resumed run gets the same knn without
any saved state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from memlm.memory.config import MemoryConfig

from memlm.memory.product_keys import ProductKeys


def knn_at_step(step: int, knn: int, start: int = 0, steps: int = 0) -> int:
    """The training knn at `step` (0-based): `start` at step 0, linearly to
    `knn` at step `steps`, `knn` afterwards (rounded to the nearest integer).
    start = 0 or steps = 0 -> always `knn`."""
    if start <= 0 or steps <= 0 or step >= steps:
        return knn
    return round(start + (knn - start) * max(step, 0) / steps)


def set_knn(model: nn.Module, knn: int | None = None, eval_knn: int | None = None) -> int:
    """Set the training (and/or evaluation) knn of every memory layer in
    `model`; returns how many lookups were changed. Each value is checked
    against the layer's n_keys (a ValueError from the lookup's setter)."""
    changed = 0
    for module in model.modules():
        if isinstance(module, ProductKeys):
            if knn is not None:
                module.knn = knn
            if eval_knn is not None:
                module.eval_knn = eval_knn
            changed += 1
    return changed


def apply_knn_schedule(model: nn.Module, memory_cfg: MemoryConfig, step: int) -> int | None:
    """Set every memory layer's training knn for `step` from a MemoryConfig.

    Returns the knn set, or None when the config has no schedule (nothing is
    touched, so a knn set by hand stays)."""
    start = memory_cfg.knn_schedule_start
    steps = memory_cfg.knn_schedule_steps
    if start <= 0 or steps <= 0:
        return None
    knn = knn_at_step(step, memory_cfg.knn, start, steps)
    set_knn(model, knn)
    return knn
