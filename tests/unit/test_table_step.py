"""The table's AdamW step (memory/fast/table_step.py): the Triton kernel
against the CPU reference, and the reference against torch's clip + AdamW."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from memlm.memory.fast.table_step import table_adamw_
from memlm.memory.table_adamw import TableAdamW
from memlm.memory.table_grads import TABLES, set_clip_coefficient

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)


def _state(dtype, seed=0, rows=37, cols=24):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(rows, cols, generator=g).to(dtype)
    grad = torch.randn(rows, cols, generator=g).to(dtype)
    m = torch.randn(rows, cols, generator=g) * 0.1
    v = torch.rand(rows, cols, generator=g) * 0.01
    return p, grad, m, v


def test_reference_equals_torch_clip_then_fused_adamw():
    # The CPU op is torch's own arithmetic: clip_grads_with_norm_'s multiply, then AdamW(fused=True).
    p, g, m, v = _state(torch.float32)
    coef = torch.tensor(0.37)
    ref_p, ref_g = p.clone(), g.clone()
    ref = torch.optim.AdamW([ref_p], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, fused=True)
    ref_p.grad = ref_g
    ref_g.mul_(coef)
    ref.step()  # first step: zero moments
    table_adamw_(p, g, torch.zeros_like(m), torch.zeros_like(v), torch.zeros(()), coef, None, **HYPER)
    assert torch.equal(p, ref_p)
    assert torch.equal(g, torch.zeros_like(g))  # the buffer is left zero


def test_found_inf_changes_nothing_but_zeroes_the_buffer():
    p, g, m, v = _state(torch.float32)
    before = [t.clone() for t in (p, m, v)]
    table_adamw_(p, g, m, v, torch.tensor(3.0), None, torch.tensor(1.0), **HYPER)
    assert all(torch.equal(a, b) for a, b in zip((p, m, v), before))
    assert not g.any()


def test_table_adamw_keeps_buffers_and_clips_in_step():
    torch.manual_seed(0)
    dense, table = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(10, 3))
    opt = TableAdamW([{"params": [dense]}, {"params": [table], TABLES: True}], lr=1e-2)
    buffer = table.grad
    assert buffer is not None and not buffer.any()  # attached at construction (no recompile under compile)
    assert set(opt.state[table]) == {"step", "exp_avg", "exp_avg_sq"}  # the state too: a loader loads into it
    ref_table = table.detach().clone().requires_grad_()
    ref = torch.optim.AdamW([ref_table], lr=1e-2, fused=True)
    for step in range(3):
        x = torch.randn(5, 3)
        (table * x.sum()).sum().backward()
        (dense.sum() * 0).backward()
        (ref_table * x.sum()).sum().backward()
        coef = torch.tensor(0.5 if step == 1 else 1.0)
        set_clip_coefficient(opt, [table], coef)
        ref_table.grad.mul_(coef)
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        assert table.grad is buffer and not buffer.any()  # the same buffer, kept and zero, after every step
        assert dense.grad is None
        assert torch.equal(table.detach(), ref_table.detach())


# The Triton kernel under the interpreter, in a child process (TRITON_INTERPRET is read at import).
_KERNEL_CHECK = r"""
import torch
from memlm.memory.fast import table_step
from memlm.memory.fast.table_step import _reference_step
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for coef, found in ((None, None), (torch.tensor(0.3), torch.tensor(0.0)), (torch.tensor(0.3), torch.tensor(1.0))):
        p = torch.randn(33, 40).to(dtype); g = torch.randn(33, 40).to(dtype)
        m = torch.randn(33, 40) * 0.1; v = torch.rand(33, 40) * 0.01
        a = [t.clone() for t in (p, g, m, v)]; b = [t.clone() for t in (p, g, m, v)]
        step = torch.tensor(4.0)
        table_step._triton_step(*a, step, coef, found, 1e-2, 0.9, 0.99, 1e-8, 0.1)
        _reference_step(*b, step, coef, found, 1e-2, 0.9, 0.99, 1e-8, 0.1)
        assert not a[1].any() and not b[1].any()
        tol = 1e-6 if dtype == torch.float32 else 8e-3
        for x, y, name in zip(a[::2] + a[3:], b[::2] + b[3:], "pmv"):
            err = ((x.float() - y.float()).abs().max() / y.float().abs().max()).item()  # of the tensor's scale
            assert err <= tol, (dtype, coef, found, name, err)
print("kernel ok")
"""


def test_triton_kernel_matches_the_reference():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kernel ok" in out.stdout
