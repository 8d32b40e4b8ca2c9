"""Lazy row-wise AdamW for value tables with sparse (row) gradients.

With `memory.sparse_updates=true` the value table's gradient is a sparse COO
tensor holding only the rows read in the step (memory/ops.py). Dense AdamW
would rewrite all N rows and both moment buffers every step, so its cost
grows with N; `SparseRowAdamW` updates only the rows in the gradient:

    for each touched row r (duplicate indices summed first), with g = grad[r]:
        p[r] *= 1 - lr * weight_decay                    (decoupled decay)
        m[r]  = beta1 * m[r] + (1 - beta1) * g
        v[r]  = beta2 * v[r] + (1 - beta2) * g * g
        p[r] -= lr / (1 - beta1**t) * m[r] / (sqrt(v[r]) / sqrt(1 - beta2**t) + eps)

with t the optimizer's step count. These are exactly torch.optim.AdamW's
updates for every touched row.

Trade-off (why it is a switch, not the default): rows that are not read in a
step are frozen for that step. Dense AdamW would still move them (their
momentum m keeps pushing after the reads stop), decay their moments, and
apply weight decay; the lazy optimizer does none of that until the row is read
again, and the bias correction uses the global step, not the row's own number
of updates. This is the standard treatment of huge embedding tables in
recommender systems (cf. torch.optim.SparseAdam, which is this without weight
decay); in exchange, a step costs O(rows read), not O(N).

Dense gradients are accepted too (then every row is touched and this is
plain AdamW), so the optimizer can hold any parameter.

Skipping a step on the device: like torch's fused AdamW, a `found_inf`
attribute (a (,) float tensor, set by the caller around `step()`) equal to
1.0 makes the step change nothing (parameters, moments, step count) without
reading the flag on the host. The step count is a device tensor for this.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim.adamw import adamw

from memlm.memory.hugepages import advise_huge_pages


class SparseRowAdamW(torch.optim.Optimizer):
    # Honours `self.found_inf` (as torch.amp.GradScaler expects of fused optimizers).
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}: expected >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid betas {betas}: each in [0, 1)")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"invalid eps={eps} or weight_decay={weight_decay}: expected >= 0")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = _zeros_like_table(p)
                    state["exp_avg_sq"] = _zeros_like_table(p)
                elif not torch.is_tensor(state["step"]):  # a state saved when the count was an int
                    state["step"] = torch.tensor(float(state["step"]), device=p.device)
                if p.grad.is_sparse:
                    self._sparse_update(p, p.grad, state, group, found_inf)
                else:
                    self._dense_update(p, p.grad, state, group, found_inf)
                # The count moves only for a step taken (1 - found_inf), on the device.
                state["step"].add_(1.0 if found_inf is None else 1.0 - found_inf.to(state["step"].device))
        return loss

    def _dense_update(self, p, grad, state, group, found_inf=None) -> None:
        _adamw(p, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], group, found_inf)

    def _sparse_update(self, p, grad, state, group, found_inf=None) -> None:
        rows, g = sparse_rows(grad)  # (U,), (U, ...)
        m_all, v_all = state["exp_avg"], state["exp_avg_sq"]
        # Chunks of rows: gather, update as dense AdamW would, write back. Small
        # chunks keep the gathered rows in cache, so main memory sees each
        # touched row of p, m, v about once each way (3-4x faster on CPU than
        # one big gather).
        for chunk, g_chunk in zip(rows.split(ROW_CHUNK), g.split(ROW_CHUNK)):
            p_rows = p.index_select(0, chunk)
            m_rows = m_all.index_select(0, chunk)
            v_rows = v_all.index_select(0, chunk)
            _adamw(p_rows, g_chunk, m_rows, v_rows, state["step"], group, found_inf)
            p.index_copy_(0, chunk, p_rows)
            m_all.index_copy_(0, chunk, m_rows)
            v_all.index_copy_(0, chunk, v_rows)


# Rows per gather/update/scatter chunk of a sparse update (512 rows of 512
# floats: 1 MB per tensor).
ROW_CHUNK = 512


def _zeros_like_table(p: torch.Tensor) -> torch.Tensor:
    """A moment buffer: zeros like `p`, on huge pages when large (its rows are
    updated at random, like the table's; see memory/hugepages.py)."""
    buf = torch.empty_like(p, memory_format=torch.preserve_format)
    advise_huge_pages(buf)  # before the first write
    return buf.zero_()


def _adamw(p, grad, m, v, steps_before: torch.Tensor, group: dict, found_inf: torch.Tensor | None = None) -> None:
    """One AdamW update of (p, m, v) in place, the step after `steps_before`
    (a (,) tensor, not modified), through torch's functional AdamW: the fused
    kernel where the device has one (one pass over the four tensors; it skips
    the update when found_inf is 1), the plain single-tensor code otherwise
    (then a skipped update is undone with torch.where)."""
    beta1, beta2 = group["betas"]
    fused = p.device.type in ("cpu", "cuda") and p.dtype in (torch.float32, torch.float16, torch.bfloat16)
    # The functional API counts the step itself (in place): pass a copy of the previous count.
    step_before = steps_before.detach().to(p.device if fused else "cpu", torch.float32, copy=True)
    kwargs = dict(amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                  weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
    if fused or found_inf is None:
        adamw([p], [grad], [m], [v], [], [step_before], foreach=False, fused=fused,
              found_inf=found_inf if fused else None, **kwargs)
        return
    old = [t.clone() for t in (p, m, v)]
    adamw([p], [grad], [m], [v], [], [step_before], foreach=False, fused=False, **kwargs)
    skip = found_inf.to(p.device) > 0
    for new, before in zip((p, m, v), old):
        new.copy_(torch.where(skip, before, new))


def sparse_rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows (U,), summed row gradients (U, ...)) of a sparse COO gradient.

    Autograd drops the `coalesced` flag when it stores a gradient, even when
    the rows are already sorted and distinct (one memory layer's gradient
    from memory/ops.py); re-coalescing would sort and copy every row again,
    so check the order first (O(U)) and coalesce only when needed (several
    layers' gradients accumulated into a shared table)."""
    if grad.is_coalesced():
        return grad.indices()[0], grad.values()
    rows, values = grad._indices()[0], grad._values()
    if rows.numel() <= 1 or bool((rows[1:] > rows[:-1]).all()):
        return rows, values
    grad = grad.coalesce()
    return grad.indices()[0], grad.values()


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the global L2 norm of the gradients of `params` to `max_norm`,
    for dense and sparse (COO) gradients alike; returns the norm before
    clipping. torch.nn.utils.clip_grad_norm_ rejects sparse gradients. Sparse
    gradients are coalesced in place first: the norm is the norm of their sum."""
    grads = []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            rows, values = sparse_rows(p.grad)
            p.grad = torch.sparse_coo_tensor(
                rows.unsqueeze(0), values, p.grad.shape, is_coalesced=True, check_invariants=False
            )
            grads.append(values)
        else:
            grads.append(p.grad)
    if not grads:
        return torch.zeros(())
    total = torch.stack([g.float().pow(2).sum() for g in grads]).sum().sqrt()
    if max_norm > 0:
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
    return total
