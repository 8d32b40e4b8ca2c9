"""Row-wise SGD for value tables: the optimizer of Lin et al.'s sparse memory
fine-tuning, for gradients that hold a few rows (memory/slot_selection.py).

    opt = SparseRowSGD([table], lr=100.0)
    loss.backward(); restrict_table_grad_(table, rows); opt.step()

For each row r in the gradient (sparse COO, or every row of a dense one):

    p[r] *= 1 - lr * weight_decay      (decoupled decay, touched rows only)
    p[r] -= lr * grad[r]

Rows not in the gradient are not touched at all (bitwise unchanged), and
there is no state. Like SparseRowAdamW it reads a column-sharded table's
gradient where it is kept (memory/sparse_adamw.table_grad) and honours a
`found_inf` device flag (1.0: the step changes nothing, decided on the device).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from memlm.memory.sparse_adamw import RowOptimizer, _scale_, local_tensor, sparse_rows


class SparseRowSGD(RowOptimizer):
    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict], lr: float = 1.0, weight_decay: float = 0.0):
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"invalid lr={lr} or weight_decay={weight_decay}: expected >= 0")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.attach_table_buffers()  # no state to make: a loader finds nothing to load

    def _update_param(self, param, grad, group, found_inf, coef) -> bool:
        if coef is not None:
            _scale_(grad, coef)
        lr, decay = group["lr"], group["weight_decay"]
        p = local_tensor(param)
        if grad.is_sparse:
            rows, g = sparse_rows(grad)
            before = p.index_select(0, rows)
        else:
            rows, g, before = None, local_tensor(grad), p
        after = before * (1.0 - lr * decay) if decay else before.clone()
        after.add_(g.to(after.dtype), alpha=-lr)
        if found_inf is not None:
            after = torch.where(found_inf.to(p.device) > 0, before, after)
        if rows is None:
            p.copy_(after)
        else:
            p.index_copy_(0, rows, after)
        return False
