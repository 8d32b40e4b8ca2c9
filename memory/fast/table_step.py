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
torch's fused AdamW (`adamw_update`) and the zeroing, in
three passes; for float32 tables it equals the clip-then-AdamW arithmetic of
torch.nn.utils.clip_grads_with_norm_ and torch.optim.AdamW(fused=True) bit
for bit. The Triton kernel is tested against it under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math

import torch
from torch.optim.adamw import adamw

from memlm.memory.fast.ops import _triton_runs_on  # one definition of where Triton runs

# Elements per Triton program.
BLOCK = 1024
# Largest float32 copy of a low-precision table a dense update makes (16 MB).
DENSE_CHUNK_ELEMENTS = 1 << 22


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
    if coef is not None:
        g.mul_(coef.to(g.device, g.dtype))
    group = {"betas": (beta1, beta2), "lr": lr, "eps": eps, "weight_decay": weight_decay}
    if p.dtype == m.dtype or p.dim() == 0:
        adamw_update(p, g, m, v, steps_before, group, found_inf)
    else:  # a bf16 table: through float32 rows, a chunk at a time (views: in place)
        rows = max(1, DENSE_CHUNK_ELEMENTS // max(1, p[0].numel()))
        for part in (slice(start, start + rows) for start in range(0, p.shape[0], rows)):
            adamw_update(p[part], g[part], m[part], v[part], steps_before, group, found_inf)
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


def adamw_update(p, grad, m, v, steps_before: torch.Tensor, group: dict,
                 found_inf: torch.Tensor | None = None) -> None:
    """One AdamW update of (p, m, v) in place, the step after `steps_before`
    (a (,) tensor, not modified), through torch's functional AdamW: the fused
    kernel where the device has one (one pass over the four tensors; it skips
    the update when found_inf is 1), the plain single-tensor code otherwise
    (then a skipped update is undone with torch.where). A parameter stored
    narrower than its moments (a bf16 table) is updated on a float32 copy,
    rounded back once (a skipped update rounds back to the same values)."""
    if p.dtype != m.dtype:
        wide = p.to(m.dtype)
        adamw_update(wide, grad.to(m.dtype), m, v, steps_before, group, found_inf)
        p.copy_(wide)
        return
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
