"""Lazy row-wise AdamW for value tables with sparse (row) gradients.

With `memory.sparse_updates=true` the value table's gradient is a sparse COO
tensor holding only the rows read in the step (memory/fast/ops.py). Dense AdamW
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

Low-precision tables (memory.value_dtype=bf16): the moments m and v are
kept in float32 whatever the parameter's dtype (torch.optim.AdamW would keep
them in bf16, where v's tiny squared gradients lose most of their bits). Each
update is computed in float32 on a float32 copy of the rows and rounded to
the table's dtype once; an update smaller than half a bf16 step of the value
(2**-9 relative) is lost. Dense updates go through the table in chunks of
rows, so the float32 copy never holds more than DENSE_CHUNK_ELEMENTS.

Sharded parameters (DTensor: FSDP shards, column-sharded value tables) are
updated through their local tensors: AdamW is elementwise, so each rank
updates its own part. A DTensor cannot hold a sparse gradient, so the row
gradient of a column-sharded table lives beside it, on the parameter:
`add_local_sparse_grad(p, g)` accumulates it (the column-parallel read does
this in its backward), `table_grad(p)` is what the optimizer and the clipping
read, and `zero_grad` clears it with the dense gradients.

Skipping a step on the device: like torch's fused AdamW, a `found_inf`
attribute (a (,) float tensor, set by the caller around `step()`) equal to
1.0 makes the step change nothing (parameters, moments, step count) without
reading the flag on the host. The step count is a device tensor for this.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from memlm.memory.fast.hugepages import advise_huge_pages
from memlm.memory.fast.table_step import DENSE_CHUNK_ELEMENTS, table_adamw_
from memlm.memory.fast.table_step import adamw_update as _adamw  # torch's functional AdamW, one update
from memlm.memory.table_grads import TABLES, TableGradients


def _scale_(grad: torch.Tensor, coef: torch.Tensor) -> None:
    """Multiply a gradient by the clip coefficient in place: a sparse one's
    coalesced rows (memlm.distributed.clip coalesced it for the norm), a
    DTensor's local tensor."""
    if grad.is_sparse:
        values = grad._values()
        values.mul_(coef.to(values.device, values.dtype))
        return
    local = local_tensor(grad)
    local.mul_(coef.to(local.device, local.dtype))


class RowOptimizer(TableGradients, torch.optim.Optimizer):
    """The frame the table optimizers share (this one, memory/sparse_sgd.py): a
    step reads each parameter's gradient where the table keeps it
    (`table_grad`), scales it by the group's clip coefficient
    (memory/table_grads.py), hands it to `_update_param`, and passes the
    `found_inf` flag on; `zero_grad` also clears the row gradients kept
    beside DTensors. A `TABLES` group's dense buffers are zeroed by the step
    and kept (memory/table_grads.py)."""

    # Honours `self.found_inf` (as torch.amp.GradScaler expects of fused optimizers).
    _step_supports_amp_scaling = True

    def after_zero_grad(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                clear_local_sparse_grad(p)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            coef = self.take_clip_coefficient(group)
            for param in group["params"]:
                grad = table_grad(param)
                if grad is None:
                    continue
                # A table kept in host memory (memlm.memory.host_tables) takes the skip flag there.
                flag = found_inf if found_inf is None else found_inf.to(local_tensor(param).device)
                zeroed = self._update_param(param, grad, group, flag, coef)
                if group.get(TABLES) and not zeroed and param.grad is not None and not param.grad.is_sparse:
                    param.grad.zero_()  # the buffer, ready for the next step's reads
        self.mark_tables_zeroed()
        return loss

    def _update_param(self, param: torch.Tensor, grad: torch.Tensor, group: dict, found_inf: torch.Tensor | None,
                      coef: torch.Tensor | None) -> bool:
        """Update `param` from `grad` scaled by `coef` (None: 1); return
        whether the update also zeroed the gradient (a table buffer)."""
        raise NotImplementedError


class SparseRowAdamW(RowOptimizer):

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
        for group in self.param_groups:  # the state the first step would make (memlm.memory.table_grads)
            for p in group["params"]:
                if p.requires_grad:
                    self._init_state(p)
        self.attach_table_buffers()

    def _init_state(self, param: torch.Tensor) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=local_tensor(param).device)
            state["exp_avg"] = _zeros_like_table(param, moment_dtype(param.dtype))
            state["exp_avg_sq"] = _zeros_like_table(param, moment_dtype(param.dtype))

    def _update_param(self, param, grad, group, found_inf, coef) -> bool:
        self._init_state(param)
        state = self.state[param]
        if not torch.is_tensor(state["step"]):  # a state saved when the count was an int
            state["step"] = torch.tensor(float(state["step"]), device=local_tensor(param).device)
        # Local tensors of DTensors: the same storage, updated in place.
        p, moments = local_tensor(param), {k: local_tensor(state[k]) for k in ("exp_avg", "exp_avg_sq")}
        local_state = {"step": state["step"], **moments}
        zeroed = bool(group.get(TABLES)) and not grad.is_sparse
        if zeroed:  # a table buffer: clip, AdamW and zeroing in one op (memory/fast/table_step.py)
            beta1, beta2 = group["betas"]
            table_adamw_(p, local_tensor(grad), moments["exp_avg"], moments["exp_avg_sq"], state["step"], coef,
                         found_inf, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"])
        else:
            if coef is not None:
                _scale_(grad, coef)
            if grad.is_sparse:
                self._sparse_update(p, grad, local_state, group, found_inf)
            else:
                self._dense_update(p, local_tensor(grad), local_state, group, found_inf)
        # The count moves only for a step taken (1 - found_inf), on the device.
        state["step"].add_(1.0 if found_inf is None else 1.0 - found_inf.to(state["step"].device))
        return zeroed

    def _dense_update(self, p, grad, state, group, found_inf=None) -> None:
        p, grad, m, v = (local_tensor(t) for t in (p, grad, state["exp_avg"], state["exp_avg_sq"]))
        if p.dtype == m.dtype or p.dim() == 0:
            _adamw(p, grad, m, v, state["step"], group, found_inf)
            return
        # A low-precision table: through float32 rows, a chunk at a time (views: in place).
        rows = max(1, DENSE_CHUNK_ELEMENTS // max(1, p[0].numel()))
        for part in (slice(start, start + rows) for start in range(0, p.shape[0], rows)):
            _adamw(p[part], grad[part], m[part], v[part], state["step"], group, found_inf)

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


_LOCAL_SPARSE_GRAD = "local_sparse_grad"


def add_local_sparse_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Accumulate a sparse COO gradient of `param`'s local tensor (uncoalesced
    sums are fine: the reduction and the optimizer coalesce)."""
    held = getattr(param, _LOCAL_SPARSE_GRAD, None)
    setattr(param, _LOCAL_SPARSE_GRAD, grad if held is None else held + grad)


def set_local_sparse_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    setattr(param, _LOCAL_SPARSE_GRAD, grad)


def clear_local_sparse_grad(param: torch.Tensor) -> None:
    if getattr(param, _LOCAL_SPARSE_GRAD, None) is not None:
        setattr(param, _LOCAL_SPARSE_GRAD, None)


def table_grad(param: torch.Tensor) -> torch.Tensor | None:
    """`param.grad`, or the sparse gradient of its local shard kept beside it."""
    if param.grad is not None:
        return param.grad
    return getattr(param, _LOCAL_SPARSE_GRAD, None)


# Rows per gather/update/scatter chunk of a sparse update (512 rows of 512
# floats: 1 MB per tensor).
ROW_CHUNK = 512


def moment_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The moments' dtype: float32 at least (bf16 tables keep fp32 moments)."""
    return torch.promote_types(param_dtype, torch.float32)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (an alias: in-place updates reach the DTensor);
    AdamW is elementwise, so each rank updates its own shard."""
    return t.to_local() if isinstance(t, DTensor) else t


def _zeros_like_table(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A moment buffer: zeros like `p` in `dtype`, on huge pages when large
    (its rows are updated at random, like the table's; see memory/fast/hugepages.py)."""
    buf = torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format)
    advise_huge_pages(local_tensor(buf))  # before the first write
    return buf.zero_()


def sparse_rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows (U,), summed row gradients (U, ...)) of a sparse COO gradient.

    Autograd drops the `coalesced` flag when it stores a gradient, even when
    the rows are already sorted and distinct (one memory layer's gradient
    from memory/fast/ops.py); re-coalescing would sort and copy every row again,
    so check the order first (O(U)) and coalesce only when needed (several
    layers' gradients accumulated into a shared table)."""
    if grad.is_coalesced():
        return grad.indices()[0], grad.values()
    rows, values = grad._indices()[0], grad._values()
    if rows.numel() <= 1 or bool((rows[1:] > rows[:-1]).all()):
        return rows, values
    grad = grad.coalesce()
    return grad.indices()[0], grad.values()


def coalesce_table_grad_(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient of `param` as clipping sees it: a dense gradient as it is;
    a sparse one (table_grad: `.grad` or a shard's gradient kept beside it)
    coalesced in place, returned as its row values (U, ...), so the norm is
    the norm of the summed rows and scaling them scales the gradient."""
    grad = table_grad(param)
    if grad is None or not grad.is_sparse:
        return grad
    rows, values = sparse_rows(grad)
    merged = torch.sparse_coo_tensor(rows.unsqueeze(0), values, grad.shape, is_coalesced=True,
                                     check_invariants=False)
    if param.grad is not None:
        param.grad = merged
    else:
        set_local_sparse_grad(param, merged)
    return values


@torch.no_grad()
def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the global L2 norm of the gradients of `params` (one process) to
    `max_norm`, for dense and sparse (COO) gradients alike; returns the norm
    before clipping. torch.nn.utils.clip_grad_norm_ rejects sparse gradients.
    Sparse gradients are coalesced in place first: the norm is the norm of
    their sum. (Sharded tables: memlm.distributed.clip sums over the shards.)"""
    grads = [g for p in params if (g := coalesce_table_grad_(p)) is not None]
    if not grads:
        return torch.zeros(())
    total = torch.stack([g.float().pow(2).sum() for g in grads]).sum().sqrt()
    if max_norm > 0:
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
    return total
