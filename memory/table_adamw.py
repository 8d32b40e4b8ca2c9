"""AdamW whose table groups keep their gradient buffers and take their clip in the step.

    opt = TableAdamW([{"params": dense}, {"params": tables, TABLES: True, "lr": 1e-3}], lr=3e-4)

Every group but the `TABLES` ones is torch.optim.AdamW(fused=True) as it is
(one multi-tensor kernel per group, `found_inf` honoured on the device). A
table of a `TABLES` group is updated by `table_adamw_`
(memory/fast/table_step.py): the group's clip coefficient applied as the
gradient is read, AdamW, and the buffer zeroed for the next step's reads, one
pass on CUDA (memory/table_grads.py says why the buffers are kept). Its
state has torch's AdamW keys and types (`step` a float32 device tensor,
`exp_avg`, `exp_avg_sq`), so checkpoints move between the two.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from memlm.memory.fast.table_step import table_adamw_
from memlm.memory.table_grads import TABLES, TableGradients


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class TableAdamW(TableGradients, torch.optim.AdamW):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        for group in self.param_groups:  # the state the first step would make (memlm.memory.table_grads)
            for p in group["params"]:
                if p.requires_grad:
                    self._init_state(p)
        self.attach_table_buffers()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g.get(TABLES)]
        try:
            if self.param_groups:
                super().step()  # torch's fused AdamW over the other groups
        finally:
            self.param_groups = groups
        found_inf = getattr(self, "found_inf", None)
        for group in groups:
            if group.get(TABLES):
                coef = self.take_clip_coefficient(group)
                for p in group["params"]:
                    if p.grad is not None:
                        self._table_step(p, coef, group, found_inf)
        self.mark_tables_zeroed()
        return loss

    def _init_state(self, p: torch.Tensor) -> None:
        """torch's AdamW(fused=True) state of `p`, as its first step makes it."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _table_step(self, p: torch.Tensor, coef, group: dict, found_inf) -> None:
        self._init_state(p)
        state = self.state[p]
        beta1, beta2 = group["betas"]
        table_adamw_(_local(p), _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                     state["step"], coef, found_inf, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                     weight_decay=group["weight_decay"])
        state["step"].add_(1.0 if found_inf is None else 1.0 - found_inf.to(state["step"].device))
