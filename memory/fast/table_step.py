"""One AdamW step of a table whose gradient buffer the reads accumulate into.

    table_adamw_(p, g, m, v, steps_before, coef, found_inf, lr=..., beta1=..., beta2=..., eps=..., weight_decay=...)

With c = coef (the table group's clip coefficient, a (,) device tensor, or
None for 1) and t = steps_before + 1, for every element:

    g' = c * g
    p *= 1 - lr * weight_decay                         (decoupled decay)
    m  = beta1 * m + (1 - beta1) * g'
    v  = beta2 * v + (1 - beta2) * g' * g'
    p -= lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)
    g  = 0                                             (the buffer, ready for the next step's reads)

A `found_inf` (,) device flag equal to 1 leaves p, m and v unchanged (the
buffer is still zeroed). p is float32 or bfloat16; m and v are float32 (a
bf16 table is updated in float32 and rounded once, like
memlm.memory.sparse_adamw). `steps_before` is not modified.

Why one op: the table is the largest tensor of a step, and the step's
traffic on it is what the clip multiply, AdamW and the zeroing of the buffer
add up to. On CUDA it is one Triton kernel: p, g, m, v read once, p, m, v
written once and g zeroed, the clip coefficient applied in registers. On CPU
the op is the reference: the clip multiply (skipped without a coefficient),
torch's fused AdamW (memlm.memory.sparse_adamw._adamw) and the zeroing, in
three passes; for float32 tables it equals the clip-then-AdamW arithmetic of
torch.nn.utils.clip_grads_with_norm_ and torch.optim.AdamW(fused=True) bit
for bit. The Triton kernel is tested against it under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math

import torch

from memlm.memory.fast.ops import _triton_runs_on  # one definition of where Triton runs

# Elements per Triton program.
BLOCK = 1024


def table_adamw_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, steps_before: torch.Tensor,
                 coef: torch.Tensor | None, found_inf: torch.Tensor | None, *, lr: float, beta1: float,
                 beta2: float, eps: float, weight_decay: float) -> None:
    """p, g: (...) the table and its gradient buffer (same shape); m, v:
    float32 moments of that shape; steps_before, coef, found_inf: (,) tensors."""
    if not (p.shape == g.shape == m.shape == v.shape):
        raise ValueError(f"table, gradient and moments must share a shape, got {tuple(p.shape)}, "
                         f"{tuple(g.shape)}, {tuple(m.shape)}, {tuple(v.shape)}")
    torch.ops.memlm.table_adamw_(p, g, m, v, steps_before, coef, found_inf, float(lr), float(beta1), float(beta2),
                                 float(eps), float(weight_decay))


@torch.library.custom_op("memlm::table_adamw_", mutates_args=("p", "g", "m", "v"))
def _table_adamw_op(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, steps_before: torch.Tensor,
                    coef: torch.Tensor | None, found_inf: torch.Tensor | None, lr: float, beta1: float, beta2: float,
                    eps: float, weight_decay: float) -> None:
    if _triton_runs_on(p.device) and p.is_contiguous() and g.is_contiguous() and m.is_contiguous() \
            and v.is_contiguous() and p.dtype in (torch.float32, torch.bfloat16):
        _triton_step(p, g, m, v, steps_before, coef, found_inf, lr, beta1, beta2, eps, weight_decay)
        return
    _reference_step(p, g, m, v, steps_before, coef, found_inf, lr, beta1, beta2, eps, weight_decay)


@_table_adamw_op.register_fake
def _(p, g, m, v, steps_before, coef, found_inf, lr, beta1, beta2, eps, weight_decay):
    return None


def _reference_step(p, g, m, v, steps_before, coef, found_inf, lr, beta1, beta2, eps, weight_decay) -> None:
    # torch's AdamW, fused where the device has it (memory/sparse_adamw.py)
    from memlm.memory.sparse_adamw import DENSE_CHUNK_ELEMENTS, _adamw

    if coef is not None:
        g.mul_(coef.to(g.device, g.dtype))
    group = {"betas": (beta1, beta2), "lr": lr, "eps": eps, "weight_decay": weight_decay}
    if p.dtype == m.dtype or p.dim() == 0:
        _adamw(p, g, m, v, steps_before, group, found_inf)
    else:  # a bf16 table: through float32 rows, a chunk at a time (views: in place)
        rows = max(1, DENSE_CHUNK_ELEMENTS // max(1, p[0].numel()))
        for part in (slice(start, start + rows) for start in range(0, p.shape[0], rows)):
            _adamw(p[part], g[part], m[part], v[part], steps_before, group, found_inf)
    g.zero_()


def _triton_step(p, g, m, v, steps_before, coef, found_inf, lr, beta1, beta2, eps, weight_decay) -> None:
    from memlm.memory.fast.table_step_kernel import table_adamw_kernel

    n = p.numel()
    if n == 0:
        return
    dummy = steps_before  # a valid pointer for an absent flag (never read)
    # log(beta) for the bias corrections beta**t = exp(t * log(beta)) on the
    # device (t is a device tensor: no host read); beta 0 -> no correction.
    log_b1 = math.log(beta1) if beta1 > 0 else -math.inf
    log_b2 = math.log(beta2) if beta2 > 0 else -math.inf
    grid = (triton_cdiv(n, BLOCK),)
    table_adamw_kernel[grid](p, g, m, v, steps_before, dummy if coef is None else coef,
                             dummy if found_inf is None else found_inf, n, lr, beta1, beta2, log_b1, log_b2, eps,
                             weight_decay, HAS_COEF=coef is not None, HAS_FOUND_INF=found_inf is not None,
                             WIDE=n >= 2**31, BLOCK=BLOCK)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
