"""Gradient norms and clipping without host syncs: one collective per group.

    norm = clip_group_(params, max_norm)   # (,) float32 on the device; grads scaled in place
    norm = clip_in_step_(optimizer, tables, max_norm)   # the same norm; the optimizer's step scales

The norm comes from `torch.nn.utils.get_total_norm(foreach=True)`: for
DTensor (FSDP-sharded, or column-sharded value) gradients it is reduced once
for the whole list, not once per parameter. DTensors on different meshes (the
value tables live on the memory mesh, dense weights on the FSDP mesh) cannot
be stacked together, so the gradients are grouped by mesh and the per-mesh
norms combined on the device: one collective per mesh. Scaling uses
`clip_grads_with_norm_`, whose coefficient stays a device tensor
(`min(1, max_norm / (norm + 1e-6))`), so nothing is read on the host. A
non-finite norm turns every gradient non-finite; the trainer's finiteness
flag then skips the optimizer step (train/step_guard.py).

Sparse (COO) value gradients (memory.sparse_updates) are the one branch:
their norm is the norm of their coalesced row values; a column-sharded table
(memory parallel) keeps its shard's sparse gradient beside the parameter
(memlm.memory.sparse_adamw.table_grad), and its squared norm is summed over
the shards (one collective per table).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from memlm.memory.sparse_adamw import coalesce_table_grad_, table_grad
from memlm.memory.table_grads import set_clip_coefficient


def _local(norm: torch.Tensor) -> torch.Tensor:
    """The norm as a plain tensor (a DTensor norm is Replicate after get_total_norm)."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _by_mesh(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors (gradients, or parameters: a DTensor's gradient lives on its
    mesh) grouped by DTensor mesh; plain tensors form one group."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def total_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm of dense gradients, plain or DTensor on any meshes; (,) float32, no host read."""
    norms = [_local(torch.nn.utils.get_total_norm(group, 2.0, foreach=True)).float()
             for group in _by_mesh(grads)]
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)): torch.nn.utils.clip_grads_with_norm_'s coefficient, on the device."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def clip_in_step_(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The norm of the gradients of `params` (dense, sparse or sharded), like
    `clip_group_`, but the scaling is left to the optimizer's step: the clip
    coefficient goes on their param groups (memlm.memory.table_grads), and
    no pass over the gradients multiplies them here."""
    with_grad = [p for p in params if table_grad(p) is not None]
    if not with_grad:
        device = params[0].device if params else torch.device("cpu")
        return torch.zeros((), dtype=torch.float32, device=device)
    if any(table_grad(p).is_sparse for p in with_grad):
        norm = _sparse_norm(with_grad)[0]
    else:
        norm = total_norm([p.grad for p in with_grad])
    if max_norm > 0:
        set_clip_coefficient(optimizer, with_grad, clip_coefficient(norm, max_norm))
    return norm


def clip_group_(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients of `params` so their global L2 norm is at most
    `max_norm` (0 -> no clipping); return the norm before clipping, a (,)
    float32 device tensor (zero when no parameter has a gradient)."""
    with_grad = [p for p in params if table_grad(p) is not None]
    if not with_grad:
        device = params[0].device if params else torch.device("cpu")
        return torch.zeros((), dtype=torch.float32, device=device)
    if any(table_grad(p).is_sparse for p in with_grad):
        return _clip_sparse_(with_grad, max_norm)
    grads = [p.grad for p in with_grad]
    norm = total_norm(grads)
    if max_norm > 0:
        # Each mesh's gradients are scaled by the same device-side coefficient
        # of the global norm.
        for group in _by_mesh(with_grad):  # parameters: clip_grads_with_norm_ scales their .grad
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, _as_like(norm, group[0]), foreach=True)
    return norm


def _as_like(norm: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The plain norm as something `param.grad` can be multiplied by: a
    replicated DTensor on the parameter's mesh (no communication) for DTensors."""
    if isinstance(param, DTensor):
        from torch.distributed.tensor import Replicate

        mesh = param.device_mesh
        return DTensor.from_local(norm, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return norm


def _clip_sparse_(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """clip_group_ for a group holding sparse gradients; one collective per
    sharded parameter (the sparse branch only)."""
    norm, grads = _sparse_norm(params)
    if max_norm > 0:
        scale = clip_coefficient(norm, max_norm)
        for g in grads:
            g.mul_(scale.to(g.dtype))
    return norm


def _sparse_norm(params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(norm, the local coalesced row values of each gradient) of a group
    holding sparse gradients, coalesced in place."""
    from torch.distributed.tensor import Partial, Replicate

    grads, squares = [], []
    for p in params:
        g = coalesce_table_grad_(p)
        local = g.to_local() if isinstance(g, DTensor) else g  # an alias: scaling it scales the gradient
        square = local.float().pow(2).sum()
        if isinstance(p, DTensor):
            # Sum the shards' parts (sharded mesh dims); replicas hold the same part.
            placements = [Partial() if pl.is_shard() else Replicate() for pl in p.placements]
            square = DTensor.from_local(square, p.device_mesh, placements, run_check=False).full_tensor()
        grads.append(local)
        squares.append(square)
    # A table in host memory (memory.engram.placement=host) has its gradient there: the norm goes where the
    # other tables' are, on the device when any is.
    device = next((s.device for s in squares if s.device.type != "cpu"), squares[0].device)
    return torch.stack([s.to(device) for s in squares]).sum().sqrt(), grads
