"""The Triton kernels compile for Hopper (sm_90) on a machine without a GPU.

The interpreter (test_kernels_triton.py) checks what the kernels compute but
not that Triton's compiler accepts them; this test runs the whole compiler
(Triton IR -> PTX -> ptxas, which the triton wheel ships) for the H100/H200
target and checks that the default block sizes do not spill registers: the
first kernels, and the "segments" ones at their default launches (int32 and
int64 offsets, dense and sparse, fused and not). It
runs in a child process so that a TRITON_INTERPRET=1 in this one (which turns
the kernels into interpreted functions at import) cannot interfere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHILD = textwrap.dedent("""
    import inspect, json, os, subprocess, sys, tempfile
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from memlm.memory.fast import triton_bag as tb
    sys.path.insert(0, "bench")
    import bag_variants as first  # the first kernels, kept for comparison

    if "constexprs" not in inspect.signature(ASTSource).parameters:
        print("UNSUPPORTED ASTSource API of triton " + triton.__version__)
        sys.exit(0)
    target = GPUTarget("cuda", 90, 32)
    blocks = dict(zip(("BLOCK_K", "BLOCK_V"), first._blocks(128, 1024)))
    # The "segments" kernels at their default launches for the paper's read
    # (16,384 bags x 128 reads, v_dim 1024, bf16), and for an fp32 table of v_dim 96.
    fwd = tb.forward_launch(1024, 128, 16384, torch.bfloat16)
    seg = tb.segments_launch(1024, torch.bfloat16)
    fwd96 = tb.forward_launch(96, 128, 16384, torch.float32)
    rows_sig = dict(values="*bf16", stride_v="i32", indices="*i32", weights="*fp32", out="*bf16", B="i32", K="i32",
                    V="i32")
    seg_sig = dict(grad_out="*bf16", values="*bf16", stride_v="i32", order="*i32", seg_start="*i32",
                   slots="*i64", weights="*fp32", grad_rows="*bf16", stride_r="i32", grad_w="*fp32",
                   seg_order="*i64", S="i32", K="i32", V="i32")
    def rows_consts(cfg, wide):
        return dict(BLOCK_B=cfg.block_b, BLOCK_K=cfg.block_k, BLOCK_D=cfg.block_d, WIDE=wide)
    def seg_consts(cfg, dense, fuse, wide, accumulate=False, ordered=False):
        return dict(BLOCK_S=cfg.block_b, BLOCK_K=cfg.block_k, BLOCK_D=cfg.block_d, DENSE=dense, FUSE_W=fuse,
                    WIDE=wide, ACCUMULATE=accumulate, ORDERED=ordered)
    new = {
        "rows_forward": (tb._rows_forward_kernel, rows_sig, rows_consts(fwd, False), fwd),
        "rows_forward_int64": (tb._rows_forward_kernel, dict(rows_sig, indices="*i64", stride_v="i64"),
                               rows_consts(fwd, True), fwd),
        "rows_forward_fp32_v96": (tb._rows_forward_kernel, dict(rows_sig, values="*fp32", out="*fp32"),
                                  rows_consts(fwd96, False), fwd96),
        "segments_dense": (tb._segments_kernel, seg_sig, seg_consts(seg, True, True, False), seg),
        "segments_sparse": (tb._segments_kernel, seg_sig, seg_consts(seg, False, True, False), seg),
        # The gradient buffer's walk (memory/fast/ops.py, grad_into): adds into the read rows.
        "segments_accumulate": (tb._segments_kernel, seg_sig, seg_consts(seg, True, True, False, True), seg),
        # The busiest-first order (Launch.busiest_first): the longest segments first.
        "segments_busiest_first": (tb._segments_kernel, seg_sig, seg_consts(seg, True, True, False, True, True), seg),
        "segments_unfused_int64": (tb._segments_kernel, dict(seg_sig, order="*i64", seg_start="*i64"),
                                   seg_consts(seg, True, False, True), seg),
    }
    kernels = {
        "forward": (first._bag_forward_kernel, dict(values="*bf16", stride_v="i32", indices="*i32",
                    weights="*fp32", out="*bf16", K="i32", V="i32"), blocks),
        "table_grad": (first._grad_by_slot_kernel, dict(grad_out="*bf16", order="*i64", seg_start="*i64",
                       weights="*fp32", grad_rows="*bf16", stride_r="i32", K="i32", V="i32"), blocks),
        "weight_grad": (tb._weight_grad_kernel, dict(values="*bf16", stride_v="i32", indices="*i64",
                        grad_out="*bf16", grad_w="*fp32", K="i32", V="i32"), blocks),
        "atomic": (first._grad_atomic_kernel, dict(grad_out="*fp32", indices="*i64", weights="*fp32",
                   grad_acc="*fp32", K="i32", V="i32"), {"BLOCK_V": blocks["BLOCK_V"]}),
    }
    kernels = {name: (fn, sig, consts, None) for name, (fn, sig, consts) in kernels.items()}
    kernels.update(new)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    DIVISIBLE = {"stride_v", "stride_r", "V", "K", "B"}
    report, scalar_bf16_loads = {}, {}
    for name, (fn, sig, consts, launch) in kernels.items():
        sig = dict(sig, **{k: "constexpr" for k in consts})
        options = {} if launch is None else {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
        # What the JIT assumes at the paper's shape: 16-byte aligned tensors; strides, V, K, B divisible by 16.
        attrs = {(i,): [["tt.divisibility", 16]] for i, (arg, kind) in enumerate(sig.items())
                 if kind.startswith("*") or arg in DIVISIBLE}
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=target,
                                  options=options)
        usage = ""
        if os.path.exists(cuobjdump):
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(compiled.asm["cubin"])
                f.flush()
                usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
        report[name] = [line.strip() for line in usage.splitlines() if "REG:" in line]
        scalar_bf16_loads[name] = compiled.asm["ptx"].count("ld.global.b16")
    print("REPORT " + json.dumps(report))
    print("SCALAR " + json.dumps(scalar_bf16_loads))
""")


def test_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")  # silences a 3.9 warning
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("this triton install has no ptxas for the CUDA backend")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    if "UNSUPPORTED" in proc.stdout:
        pytest.skip(proc.stdout.strip())
    report = json.loads(proc.stdout.split("REPORT ", 1)[1].splitlines()[0])
    scalar_loads = json.loads(proc.stdout.split("SCALAR ", 1)[1].splitlines()[0])
    # The new kernels read bf16 rows as 16-byte vectors (ld.global.v4), never one element at a time.
    for name in ("rows_forward", "rows_forward_int64", "segments_dense", "segments_sparse", "segments_accumulate",
                 "segments_busiest_first"):
        assert scalar_loads[name] == 0, (name, scalar_loads)
    assert set(report) == {"forward", "table_grad", "weight_grad", "atomic", "rows_forward", "rows_forward_int64",
                           "rows_forward_fp32_v96", "segments_dense", "segments_sparse", "segments_accumulate",
                           "segments_busiest_first", "segments_unfused_int64"}
    for name, lines in report.items():
        for line in lines:  # "REG:64 STACK:0 SHARED:0 LOCAL:0 ...": STACK/LOCAL > 0 means spills
            fields = dict(item.split(":", 1) for item in line.split())
            assert fields["STACK"] == "0" and fields["LOCAL"] == "0", (name, line)
