"""The Triton kernel of memory/fast/table_step.py's `table_adamw_` (its
docstring holds the math): one program per BLOCK elements reads p, g, m, v
once, writes p, m, v once and zeroes g. Imported only where Triton runs.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def table_adamw_kernel(p, g, m, v, steps_before, coef, found_inf, n, lr, beta1, beta2, log_b1, log_b2, eps,
                       weight_decay, HAS_COEF: tl.constexpr, HAS_FOUND_INF: tl.constexpr, WIDE: tl.constexpr,
                       BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)                     # (BLOCK,)
    mask = offs < n
    grad = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(g + offs, tl.zeros((BLOCK,), dtype=tl.float32).to(g.dtype.element_ty), mask=mask)
    take = True
    if HAS_FOUND_INF:
        take = tl.load(found_inf) == 0
    if take:
        if HAS_COEF:
            grad = grad * tl.load(coef).to(tl.float32)
        t = tl.load(steps_before).to(tl.float32) + 1.0
        bc1 = 1.0 - tl.exp(t * log_b1)
        bc2 = 1.0 - tl.exp(t * log_b2)
        w = tl.load(p + offs, mask=mask, other=0.0).to(tl.float32)
        mm = tl.load(m + offs, mask=mask, other=0.0)
        vv = tl.load(v + offs, mask=mask, other=0.0)
        w = w * (1.0 - lr * weight_decay)
        mm = beta1 * mm + (1.0 - beta1) * grad
        vv = beta2 * vv + (1.0 - beta2) * grad * grad
        denom = tl.sqrt(vv) / tl.sqrt(bc2) + eps
        w = w - (lr / bc1) * (mm / denom)
        tl.store(p + offs, w.to(p.dtype.element_ty), mask=mask)
        tl.store(m + offs, mm, mask=mask)
        tl.store(v + offs, vv, mask=mask)
