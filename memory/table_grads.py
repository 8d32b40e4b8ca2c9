"""The tables' gradient buffers and clip coefficient, as every memlm optimizer keeps them.

    groups = [{"params": dense}, {"params": tables, TABLES: True}]
    opt = TableAdamW(groups, lr=...)          # or SparseRowAdamW / SparseRowSGD: all use this frame
    loss.backward()                           # every read adds into its table's buffer
    set_clip_coefficient(opt, tables, coef)   # memlm.distributed.clip: the norm, no multiply
    opt.step()                                # the table's update applies coef, then zeroes the buffer
    opt.zero_grad()                           # dense gradients dropped; table buffers kept (already zero)

A param group marked `TABLES` (the optimizer's value group when the reads'
gradients are dense) keeps one gradient buffer per table, from the
optimizer's construction on: `p.grad`, zeroed in place, never set to None
(so a compiled model sees the same `.grad` from its first step: no
recompile). These optimizers also make their state (step counts, moments)
at construction, as their first step would: a checkpoint loader that finds
neither state nor gradients runs a zero step to create the state it loads
into (torch.distributed.checkpoint's `_init_optim_state`), and one that
finds gradients but no state would load nothing.
A read of a `ValuePool` adds its rows there (memory/values.py,
`gradient_buffer`), so a step makes no dense per-read gradient and autograd
sums none; other tables (PEER's) get theirs from autograd, which adds into
an existing `.grad` in place. The step consumes the buffer and leaves it
zero (memory/fast/table_step.py), so `zero_grad` has nothing to do for
those tables after a step.

The clip of a group (memory.value_grad_clip) is not a pass of its own: the
caller computes the norm and leaves the coefficient min(1, max / (norm +
1e-6)) on the group under `CLIP_COEF` (a (,) device tensor); the optimizer's
step multiplies the gradient by it as it reads it, and drops it. A group
without one is not clipped.
"""

from __future__ import annotations

import torch

# A param group's key: its tables keep gradient buffers (dense reads).
TABLES = "tables"
# A param group's key: the clip coefficient for the next step, set by the caller, dropped by step().
CLIP_COEF = "clip_coef"


class TableGradients:
    """Mixed into a torch.optim.Optimizer subclass (before it in the bases):
    buffers kept for `TABLES` groups, `take_clip_coefficient` for the step."""

    def attach_table_buffers(self) -> None:
        """Give each table of a `TABLES` group a zero gradient buffer (call at
        the end of __init__, after the state exists: see the module docstring)."""
        self._tables_zero = True
        for group in self.param_groups:
            if group.get(TABLES):
                for p in group["params"]:
                    if p.requires_grad and p.grad is None:
                        p.grad = torch.zeros_like(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        tables_zero = getattr(self, "_tables_zero", False)
        for group in self.param_groups:
            keep = bool(group.get(TABLES))
            for p in group["params"]:
                if p.grad is None:
                    continue
                if keep and not p.grad.is_sparse:
                    if not tables_zero:
                        p.grad.zero_()
                elif set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().requires_grad_(False).zero_()
        self._tables_zero = False
        self.after_zero_grad()

    def after_zero_grad(self) -> None:
        """A hook for what an optimizer keeps beside its gradients (the row gradients of sharded tables)."""

    def mark_tables_zeroed(self) -> None:
        """The step left every table buffer zero: the next zero_grad skips them."""
        self._tables_zero = True

    @staticmethod
    def take_clip_coefficient(group: dict) -> torch.Tensor | None:
        """The group's clip coefficient for this step (removed from the group), or None."""
        return group.pop(CLIP_COEF, None)


def set_clip_coefficient(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Leave `coef` on every param group of `optimizer` that holds one of `params`."""
    if not isinstance(optimizer, TableGradients):
        raise TypeError(f"{type(optimizer).__name__} does not apply a clip coefficient in its step; "
                        "use an optimizer of memlm.memory (TableAdamW, SparseRowAdamW, SparseRowSGD)")
    ids = {id(p) for p in params}
    found = False
    for group in optimizer.param_groups:
        if any(id(p) in ids for p in group["params"]):
            group[CLIP_COEF] = coef
            found = True
    if params and not found:
        raise ValueError("set_clip_coefficient: none of the given parameters is in the optimizer")
