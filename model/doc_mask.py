"""Document masking of packed sequences: attention, and optionally RoPE positions,
that stop at document boundaries.

A packed training row holds several documents back to back. `doc_ids`
(batch, seq) numbers them along each row, non-decreasing (the loader makes
them: `memlm.data.loader.document_ids`). The transformer builds one mask per
forward and every layer shares it:

    mask = doc_attention_mask(doc_ids, backend="auto")  # BlockMask (flex) or (batch, 1, seq, seq) bool
    out = attend(q, k, v, mask)                          # in Attention.forward
    positions = doc_positions(doc_ids)                   # RoPE restart: 0 at each document's first token

Query i sees key j iff j <= i and both lie in the same document.

Backends: `flex` is FlexAttention with a block mask (`torch.nn.attention.flex_attention`,
compiled: it skips whole blocks that cross documents and never materializes the
(seq, seq) scores). torch has no FlexAttention backward on CPU, so `auto` uses
it on CUDA only; `sdpa` (and `auto` elsewhere) passes a boolean (batch, 1, seq, seq)
mask to `scaled_dot_product_attention`. Both give the same numbers (tests/unit/test_doc_mask.py).

The block mask is built once per forward (the model's, shared by every layer)
by a compiled builder on CUDA: `create_block_mask` run eagerly evaluates the
mask function over the whole (batch, seq, seq) grid, with int64 temporaries
of that size (5 GiB and 10 s at batch 8, seq 8192 on 2 CPU cores), where
compiled it reduces each 128 x 128 block as it goes (2 MiB, 1.3 s there;
bench/doc_mask.py, docs/benchmarks.md). One compile per (batch, seq) shape;
a training run has one.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from memlm.errors import ConfigError

BACKENDS = ("auto", "flex", "sdpa")

try:  # torch >= 2.5; "where available"
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover - older torch
    BlockMask = create_block_mask = flex_attention = None


def resolve_backend(backend: str, device: torch.device) -> str:
    """`auto` -> flex on CUDA when this torch has FlexAttention, else sdpa."""
    if backend not in BACKENDS:
        raise ConfigError("model.doc_mask_backend", backend, f"one of: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "flex" if device.type == "cuda" and flex_attention is not None else "sdpa"
    if backend == "flex" and flex_attention is None:
        raise ConfigError("model.doc_mask_backend", backend,
                          f"auto or sdpa: torch {torch.__version__} has no torch.nn.attention.flex_attention")
    if backend == "flex" and device.type != "cuda" and torch.is_grad_enabled():
        raise ConfigError("model.doc_mask_backend", backend,
                          "auto or sdpa when training on CPU (torch has no FlexAttention backward on CPU; "
                          "flex runs on CPU only under torch.no_grad())")
    return backend


def doc_attention_mask(doc_ids: torch.Tensor, backend: str = "auto") -> Any:
    """The causal same-document mask of `doc_ids` (batch, seq): a flex BlockMask,
    or a (batch, 1, seq, seq) bool tensor (True = may attend) for SDPA."""
    if resolve_backend(backend, doc_ids.device) == "flex":
        with torch.no_grad():  # (no gradient to build; and one compiled graph for training and evaluation)
            return block_mask_builder(doc_ids.device)(doc_ids)
    seq = doc_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    return ((doc_ids[:, :, None] == doc_ids[:, None, :]) & causal)[:, None]


def same_doc_block_mask(doc_ids: torch.Tensor) -> Any:
    """The causal same-document BlockMask of `doc_ids` (batch, seq), by
    create_block_mask as called: run eagerly, it materializes the (batch, 1,
    seq, seq) mask and its int64 index temporaries; under torch.compile it
    fuses them into per-block reductions (block_mask_builder)."""
    def same_doc_causal(b, h, q, kv):
        return (doc_ids[b, q] == doc_ids[b, kv]) & (q >= kv)

    bsz, seq = doc_ids.shape
    return create_block_mask(same_doc_causal, bsz, None, seq, seq, device=doc_ids.device)


@functools.cache
def _compiled_block_mask():
    # torch.compile(create_block_mask)'s way (what create_block_mask(_compile=True) does from
    # torch 2.10 on, deprecated there): the whole builder in one graph, the closure over doc_ids
    # traced, so a new batch of the same shape reuses the graph. dynamic=False: a compile per
    # (batch, seq), as the flex kernel itself (_compiled_flex).
    return torch.compile(same_doc_block_mask, dynamic=False)


def block_mask_builder(device: torch.device):
    """doc_ids (batch, seq) -> BlockMask: compiled where FlexAttention runs
    compiled and trains (CUDA). On CPU flex is the eager reference path, no
    backward, which materializes the (batch, heads, seq, seq) scores itself,
    so the mask's temporaries do not bound it, and each new shape would pay
    a C++ compile (~30 s on 2 cores): eager there."""
    return _compiled_block_mask() if device.type == "cuda" else same_doc_block_mask


def doc_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq) int64: each token's offset from its document's first token in the row."""
    seq = doc_ids.shape[1]
    idx = torch.arange(seq, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # start of own document
    return idx - first


@functools.cache
def _compiled_flex():
    # Eager flex_attention is a reference path that materializes every score; compiled it is a fused kernel.
    return torch.compile(flex_attention, dynamic=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, enable_gqa: bool) -> torch.Tensor:
    """Masked attention. q: (batch, heads, seq, head_dim); k, v: (batch, kv_heads, seq, head_dim);
    mask from `doc_attention_mask` -> (batch, heads, seq, head_dim)."""
    if BlockMask is not None and isinstance(mask, BlockMask):
        # Inside a compiled block (parallel.compile) the compiler already fuses flex_attention.
        eager_cuda = q.device.type == "cuda" and not torch.compiler.is_compiling()
        fn = _compiled_flex() if eager_cuda else flex_attention
        return fn(q, k, v, block_mask=mask, enable_gqa=enable_gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
