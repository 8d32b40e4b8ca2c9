"""Full-float32 matmuls for the product-key lookup, whatever the caller's precision settings.

The top-k of the product-key search is discontinuous: a score rounded by
2**-11 (TF32's 10-bit significand) or 2**-9 (bf16) swaps close candidates. At
n_keys 1024, k_dim 512, knn 32, TF32 operands change the selected set of 2-3%
of the lookups, a bf16 query projection about 20% (tests/integration/test_precision.py
measures both). So the lookup's two matmuls, the query projection and the
sub-key scores, run here in IEEE float32 (or the inputs' wider dtype):

    with no_tf32():                            # TF32 off for CUDA float32 matmuls, the caller's setting restored after
        sub = subkey_scores(q, keys)
    q = exact_linear(x, weight, bias)          # (T, in) -> (T, out): F.linear with TF32 off
    sub = exact_subkey_scores(q, keys)         # (T, H, 2, half) x (H, 2, n_keys, half) -> (T, H, 2, n_keys)

`no_tf32` sets a process-wide flag: a Python side effect, which a compiled
graph would not replay when it runs. So the matmuls that need it are custom ops (`memlm::exact_linear`,
`memlm::exact_subkey_scores`; the search op memlm::product_key_search uses
no_tf32 directly): opaque to the compiler, run eagerly at run time with TF32
off, without a graph break. Their backward is plain PyTorch (traced under
torch.compile) at the caller's precision: a gradient is not a selection, and
TF32's rounding of it is noise next to bf16 training's.

Callers turn autocast off around these and pass float32 inputs: these
functions do not cast. The autocast side of the same rule lives here too:

    with full_precision(x.device):             # autocast off for x's device (a no-op where it has none)
        q = exact_linear(x.float(), w.float(), b.float())
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from memlm.memory.fast.search import subkey_scores

_MATMUL = torch.backends.cuda.matmul


def _autocast_device_types() -> frozenset[str]:
    """The device types this torch build has autocast for, read once at import."""
    names = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "mtia", "maia", "meta",
             torch._C._get_privateuse1_backend_name())
    found = set()
    for name in names:
        try:
            if torch.amp.is_autocast_available(name):
                found.add(name)
        except RuntimeError:  # a device type this build does not know
            pass
    return frozenset(found)


# A set lookup, not torch.amp.is_autocast_available at each call: torch.compile
# 2.11 cannot trace that builtin (torch._C._is_autocast_available) and breaks
# the graph at every call on CUDA (found by bench/device_check.sh on an H200:
# 10 breaks and 30 graphs for one Memory+ block); a frozenset it traces.
AUTOCAST_DEVICE_TYPES = _autocast_device_types()


def autocast_available(device_type: str) -> bool:
    """torch.amp.is_autocast_available(device_type), traceable by torch.compile."""
    return device_type in AUTOCAST_DEVICE_TYPES


def full_precision(device: torch.device) -> contextlib.AbstractContextManager:
    """A context with autocast off for `device`: the product-key scores, their
    top-k and the softmax then run in their inputs' dtype (the callers upcast
    to float32). Under autocast(bf16) the scoring einsum would otherwise come
    out bf16, whose 8-bit significand ties close scores and loses softmax
    mass. torch.compile traces it (no graph break); devices without autocast
    (meta) get a no-op context."""
    if not autocast_available(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


@contextlib.contextmanager
def no_tf32() -> Iterator[None]:
    """CUDA float32 matmuls in IEEE float32 inside (cuBLAS without TF32),
    the caller's setting restored after, also on error.

    torch keeps this setting twice: the legacy flag
    (`torch.backends.cuda.matmul.allow_tf32`, also set by
    torch.set_float32_matmul_precision and by
    memlm.distributed.precision.enable_tf32) and, from torch 2.9, the per-backend
    `torch.backends.cuda.matmul.fp32_precision`, which cuBLAS reads there. A
    legacy write sets both; a legacy read raises once a new-API write made
    them disagree. So this writes through the legacy flag, keeping the two
    in agreement for whatever runs inside, unless the caller uses the new
    API (the legacy read refuses): then through that one. On CPU nothing
    here changes what a float32 matmul computes (memlm never lowers
    torch.set_float32_matmul_precision, which would let oneDNN use TF32 on
    AMX; that setting is left alone). Process-wide, like the flags: nothing
    may run float32 matmuls on another thread meanwhile (training runs
    forward and backward in turn, not at once)."""
    try:
        legacy = _MATMUL.allow_tf32
    except RuntimeError:  # the caller set fp32_precision (torch >= 2.9): the legacy read refuses
        legacy = None
    if legacy is False:
        yield  # already IEEE: touch nothing
        return
    if legacy:
        medium = torch.get_float32_matmul_precision() == "medium"
        _MATMUL.allow_tf32 = False
    else:
        precision = _MATMUL.fp32_precision
        _MATMUL.fp32_precision = "ieee"
    try:
        yield
    finally:
        if legacy:
            _MATMUL.allow_tf32 = True
            if medium:  # the legacy flag's True is "high": "medium" comes back through its own setter
                torch.set_float32_matmul_precision("medium")
        else:
            _MATMUL.fp32_precision = precision


@torch.library.custom_op("memlm::exact_linear", mutates_args=())
def _exact_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    # x (T, in), weight (out, in), bias (out,) -> (T, out)
    with no_tf32():
        return F.linear(x, weight, bias)


@_exact_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


def _exact_linear_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)


def _exact_linear_backward(ctx, grad):
    # grad (T, out); at the caller's matmul precision (see the module docstring)
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad
    grad_x = grad @ weight if need_x else None  # (T, in)
    grad_w = grad.t() @ x if need_w else None  # (out, in)
    grad_b = grad.sum(0) if need_b else None  # (out,)
    return grad_x, grad_w, grad_b


_exact_linear_op.register_autograd(_exact_linear_backward, setup_context=_exact_linear_setup)


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (T, in), weight (out, in), bias (out,)
    -> (T, out), with TF32 off in the forward (see no_tf32), also under
    torch.compile (one opaque op). The inputs share one floating dtype."""
    if x.dim() != 2 or weight.dim() != 2 or bias.shape != weight.shape[:1] or x.shape[1] != weight.shape[1]:
        raise ValueError(f"exact_linear takes x (T, in), weight (out, in), bias (out,); got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(bias.shape)}")
    if not (x.dtype == weight.dtype == bias.dtype) or not x.dtype.is_floating_point:
        raise ValueError(f"exact_linear takes inputs of one floating dtype, got {x.dtype}, {weight.dtype}, "
                         f"{bias.dtype}: cast them first (it does not round behind the caller's back)")
    return torch.ops.memlm.exact_linear(x, weight, bias)


@torch.library.custom_op("memlm::exact_subkey_scores", mutates_args=())
def _exact_scores_op(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    # query (T, H, 2, half), keys (H, 2, n_keys, half) or (2, n_keys, half) -> (T, H, 2, n_keys)
    with no_tf32():
        return subkey_scores(query, keys).contiguous()  # (the fake kernel promises contiguous)


@_exact_scores_op.register_fake
def _(query, keys):
    return query.new_empty(*query.shape[:3], keys.shape[-2])


def _exact_scores_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _exact_scores_backward(ctx, grad):
    # grad (T, H, 2, n_keys); what autograd's einsum backward computes
    query, keys = ctx.saved_tensors
    shared = keys.dim() == 3
    need_q, need_k = ctx.needs_input_grad
    grad_q = torch.einsum("thcn,cnd->thcd" if shared else "thcn,hcnd->thcd", grad, keys) if need_q else None
    grad_k = torch.einsum("thcn,thcd->cnd" if shared else "thcn,thcd->hcnd", grad, query) if need_k else None
    return grad_q, grad_k


_exact_scores_op.register_autograd(_exact_scores_backward, setup_context=_exact_scores_setup)


def exact_subkey_scores(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """memlm.memory.fast.search.subkey_scores with TF32 off (see no_tf32), also
    under torch.compile, and differentiable: query (T, H, 2, half), keys
    (H, 2, n_keys, half) or (2, n_keys, half) -> (T, H, 2, n_keys)."""
    return torch.ops.memlm.exact_subkey_scores(query, keys)
