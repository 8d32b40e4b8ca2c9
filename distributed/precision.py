"""Mixed precision of a training run: the compute dtype, and how it is applied.

    enable_tf32(env.device)                      # once per process
    with autocast(cfg.parallel, env.device, fsdp=meshes.fsdp is not None):
        loss = loss_fn(model(inputs), targets)   # forward + loss; backward outside

`parallel.dtype` names the compute dtype (auto: bf16 on GPU, fp32 on CPU).
Weights, gradients and optimizer state stay float32 either way ("master
weights"); only the matmuls' inputs are rounded. Two mechanisms, one result:

- more than one rank: FSDP2's MixedPrecisionPolicy (distributed/parallelize.py)
  all-gathers the float32 shards as bf16, so the unsharded weights and the
  blocks compute in bf16 and the all-gathers move half the bytes; gradients
  are reduced in float32.
- one process: torch.autocast(bf16) around forward and loss. FSDP on a
  1-rank mesh would need a process group in every single-process run (and
  DTensor parameters in its checkpoints, exports and tests) to gain nothing
  a single process can use: there is no all-gather to halve. Autocast casts
  each weight to bf16 once per forward (cached), computes matmuls in bf16 and
  keeps the residual stream, norms and loss in float32.

Either way the product-key scores, their top-k and softmax, the MoE router and
the value read run with autocast off in float32 (memlm.memory.fast.exact.full_precision),
and fp32 matmuls on CUDA use TF32 (enable_tf32). The product-key lookup goes
further, so that it selects the slots the float32 model selects: its query
projection runs in float32 too, both its matmuls with TF32 off
(memlm.memory.fast.exact.no_tf32, the caller's setting restored after), and under
FSDP its parameters are gathered in float32 (distributed/parallelize.py,
FULL_PRECISION). A bf16 query changes the selected set of ~20% of the lookups
at n_keys 1024, k_dim 512, knn 32, TF32 scores ~2% (tests/integration/test_lookup_precision.py).
Evaluation loads a float32 model and runs without autocast (memlm.run.load).
docs/training.md, "Precision", has the trade-offs.
"""

from __future__ import annotations

import contextlib

import torch

from memlm.distributed.config import ParallelConfig


def compute_dtype(cfg: ParallelConfig, device: torch.device) -> torch.dtype:
    """parallel.dtype -> the dtype matmuls run in on `device`."""
    if cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def autocast(cfg: ParallelConfig, device: torch.device, fsdp: bool) -> contextlib.AbstractContextManager:
    """The context for one forward + loss: autocast to the compute dtype where
    FSDP's policy does not already cast the weights (one process), else none."""
    dtype = compute_dtype(cfg, device)
    if fsdp or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def enable_tf32(device: torch.device) -> None:
    """TF32 for float32 matmuls and convolutions on CUDA (Ampere and later):
    10-bit significand products with float32 accumulation, about 7x the
    float32 matmul throughput of an H100. This is the one place memlm sets it; it is process-wide,
    so it is left alone on CPU (where a lower matmul precision would let
    oneDNN use TF32 for CPU float32 tensors and change CPU results). The
    per-backend flags, not set_float32_matmul_precision("high"), which also
    switches oneDNN; and not the newer fp32_precision attributes, whose mix
    with the legacy API (which torch.compile's inductor still reads) raises.
    The product-key lookup turns it off around its own matmuls
    (memlm.memory.fast.exact.no_tf32)."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
