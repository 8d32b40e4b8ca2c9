"""memlm decoders in Hugging Face transformers (trust_remote_code), every FFN kind.

This file is copied verbatim into every non-dense memlm export (with
configuration_memlm.py and a config.json whose `auto_map` names both), so

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True)
    out = model.generate(input_ids, max_new_tokens=20)

loads and runs a Memory, Memory+, MoE, PEER or UltraMemV2 model, with or without
Engram layers (engram_memlm.py), where memlm is not installed: it imports torch
and transformers only. Module and parameter
names are memlm's own (tok_embeddings, layers.{i}.attention.wq, ...,
shared.memory_values.weight), so the export's safetensors load unchanged.

The math is memlm's (model/, memory/) written in plain PyTorch: the exact
product-key top-k over all knn x knn candidate sums, the memory read as
F.embedding_bag, MoE as a loop over experts, PEER's down projection as a
gather. No custom kernels, no memory parallelism, no training-only parts
(balance losses, usage statistics, sparse updates). memlm's tests
(tests/integration/test_hf_remote.py) compare this file's logits with memlm's for every
kind, so the two cannot drift apart silently.

KV cache: transformers' Cache (DynamicCache by default in generate), named
`cache` in transformers >= 5.2x and `past_key_values` before; both are accepted.
A 2-D attention_mask with padding is honoured (padded keys are masked, positions
count real tokens only; Engram hashes padding as the start of a row and zeroes its
convolution input there), as generate needs for batches of unequal prompts. An
Engram layer keeps its canonical ids and convolution inputs on the cache object
(`memlm_engram`), which beam search reorders with the cache's rows (`_reorder_cache`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_memlm import MEMORY_KEYS, ULTRAMEM_KEYS, MemlmConfig
from .engram_memlm import Engram

# transformers renamed the cache field of model outputs (past_key_values -> cache).
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
# Where an Engram layer's decoding history rides on transformers' cache object: {layer: {"canon", "conv_in"}}.
ENGRAM_HISTORY = "memlm_engram"
VALUE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu}
# The FFN kinds that read value tables (memlm.memory.config.PRODUCT_KEY_KINDS): a
# copy, because this file must run where memlm is not installed.
PRODUCT_KEY_KINDS = ("memory", "memplus")


# Read once: torch.compile 2.11 cannot trace torch.amp.is_autocast_available (a graph break per call).
_AUTOCAST_TYPES = frozenset(t for t in ("cpu", "cuda", "xpu", "mps", "hpu") if torch.amp.is_autocast_available(t))


def _full_precision(device: torch.device):
    """Autocast off: product-key scores, top-k and softmax run in float32 (as in memlm)."""
    if device.type not in _AUTOCAST_TYPES:
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


# ------------------------------------------------------------ decoder parts
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (batch, seq) -> cos, sin (batch, 1, seq, head_dim) in float32 ("rotate half" layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # (batch, seq, head_dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: MemlmConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        dim = config.hidden_size
        self.wq = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin, cache, layer_id, mask):
        # x: (batch, seq, dim); mask: None (causal) or bool (batch, 1, seq, kv_len)
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, layer_id)
        kv_len = k.shape[2]
        causal = False
        if mask is None and kv_len == seq:
            causal = seq > 1
        elif mask is None and seq > 1:
            # New queries sit at the end of the cached sequence: query i sees keys <= offset + i.
            mask = torch.ones(seq, kv_len, dtype=torch.bool, device=x.device).tril(kv_len - seq)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# ---------------------------------------------------- product-key memories
def product_key_topk(sub_scores: torch.Tensor, knn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sub_scores (T, H, 2, n_keys) -> the exact top-knn of s1[i] + s2[j] over
    all n_keys**2 pairs: scores (T, H, knn), slots i * n_keys + j (T, H, knn).
    A pair in the overall top-knn has each half in its half's top-knn, so
    the knn x knn candidate sums suffice."""
    n_keys = sub_scores.shape[-1]
    half_scores, half_idx = sub_scores.topk(knn, dim=-1)  # (T, H, 2, knn)
    cand = half_scores[:, :, 0, :, None] + half_scores[:, :, 1, None, :]  # (T, H, knn, knn)
    scores, best = cand.flatten(-2).topk(knn, dim=-1)  # (T, H, knn)
    i = half_idx[:, :, 0].gather(-1, torch.div(best, knn, rounding_mode="floor"))
    j = half_idx[:, :, 1].gather(-1, best % knn)
    return scores, i * n_keys + j


class ValuePool(nn.Module):
    """The (n_slots, v_dim) value table, owned by a layer or shared by all of them."""

    def __init__(self, n_slots: int, v_dim: int, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.weight = nn.Parameter(torch.zeros(n_slots, v_dim, dtype=dtype))

    def read(self, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """slots, weights (T, K) -> (T, v_dim): sum_k weights * table[slots], in the table's dtype."""
        if self.weight.dtype != self.dtype:
            # model.float() / .to(dtype) cast every tensor; the table's storage
            # dtype (memory.value_dtype) is part of the math, so it is restored once.
            with torch.no_grad():
                self.weight.data = self.weight.data.to(self.dtype)
        _aligned(self.weight)
        with _full_precision(slots.device):
            return F.embedding_bag(slots, self.weight, per_sample_weights=weights.to(self.weight.dtype), mode="sum")


class ProductKeys(nn.Module):
    def __init__(self, dim: int, m: dict):
        super().__init__()
        self.n_keys, self.heads, self.half = m["n_keys"], m["heads"], m["k_dim"] // 2
        self.knn, self.eval_knn, self.qk_norm = m["knn"], m["eval_knn"], m["qk_norm"]
        self.query = nn.Linear(dim, self.heads * m["k_dim"], bias=True)
        self.keys = nn.Parameter(torch.zeros(self.heads, 2, self.n_keys, self.half))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, dim) -> softmax weights (T, H*knn) float32+, slots (T, H*knn).

        As memlm's lookup: the query projection too in float32 (or wider) with
        autocast off, so the selection is the float32 model's."""
        weight, bias = self.query.weight, self.query.bias  # (H * k_dim, dim), (H * k_dim,)
        compute = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
        with _full_precision(x.device):
            q = F.linear(x.to(compute), weight.to(compute), bias.to(compute))  # (T, H * k_dim)
            q = q.view(-1, self.heads, 2, self.half)
            keys = self.keys.to(compute)
            if self.qk_norm:
                q = F.rms_norm(q, (self.half,)) * self.half**-0.5
                keys = F.rms_norm(keys, (self.half,))
            sub = torch.einsum("thcd,hcnd->thcn", q, keys)  # (T, H, 2, n_keys)
            scores, slots = product_key_topk(sub, self.knn if self.training else self.eval_knn)
            weights = scores.softmax(dim=-1)
        return weights.flatten(1), slots.flatten(1)


class ProductKeyMemory(nn.Module):
    """Memory (out = y, or W_o y) and Memory+ (out = W2(y * gate(W1 x)), with
    memory.w_bias: W2(y * gate(W1 x + b1)) + b2). `w_bias` is in config.json only
    when true: exports without it (and every export before it) have no biases."""

    def __init__(self, dim: int, m: dict, plus: bool, pool: ValuePool | None):
        super().__init__()
        self.dim, self.v_dim = dim, m["v_dim"]
        self.lookup = ProductKeys(dim, m)
        if pool is None:
            self.values = ValuePool(m["n_keys"] ** 2, self.v_dim, VALUE_DTYPES[m["value_dtype"]])
        else:
            self.__dict__["values"] = pool  # registered once, on the model (`shared`)
        self.plus = plus
        self.gate = m["gate"] if plus else "none"
        if plus:
            bias = bool(m.get("w_bias", False))
            self.w1 = nn.Linear(dim, self.v_dim, bias=bias) if self.gate != "none" else None
            self.w2 = nn.Linear(self.v_dim, dim, bias=bias)
        else:
            self.out = nn.Linear(self.v_dim, dim, bias=False) if self.v_dim != dim else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, seq, dim) -> (batch, seq, dim)
        shape = x.shape
        x = x.reshape(-1, self.dim)  # (T, dim)
        weights, slots = self.lookup(x)
        y = self.values.read(slots, weights).to(x.dtype)  # (T, v_dim)
        if not self.plus:
            return (self.out(y) if self.out is not None else y).reshape(shape)
        if self.gate == "swilu":
            y = y * F.silu(self.w1(x))
        elif self.gate == "sigmoid":
            y = y * torch.sigmoid(self.w1(x))
        return self.w2(y).reshape(shape)


class MemoryFFN(nn.Module):
    """A memory layer in the FFN slot, plus the dense FFN with placement=parallel."""

    def __init__(self, memory: ProductKeyMemory, dense: nn.Module | None):
        super().__init__()
        self.memory, self.dense = memory, dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.memory(x)
        return out + self.dense(x) if self.dense is not None else out


# ------------------------------------------------------------- MoE and PEER
class MoE(nn.Module):
    """Top-k routed SwiGLU experts, gates renormalized over the top_k (memlm model/moe.py)."""

    def __init__(self, dim: int, m: dict):
        super().__init__()
        n, hidden = m["n_experts"], m["expert_hidden_dim"]
        self.dim, self.n_experts, self.top_k = dim, n, m["top_k"]
        self.router = nn.Linear(dim, n, bias=False)
        self.w1 = nn.Parameter(torch.zeros(n, dim, hidden))
        self.w3 = nn.Parameter(torch.zeros(n, dim, hidden))
        self.w2 = nn.Parameter(torch.zeros(n, hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.dim)  # (T, dim)
        compute = torch.promote_types(x.dtype, torch.float32)
        with _full_precision(x.device):
            probs = F.linear(x.to(compute), self.router.weight.to(compute)).softmax(dim=-1)  # (T, E)
            top_p, experts = probs.topk(self.top_k, dim=-1)  # (T, k)
        gates = top_p / top_p.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.n_experts):  # experts in order: each token's outputs are summed as memlm sums them
            tok, k = (experts == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            h = F.silu(x[tok] @ self.w1[e]) * (x[tok] @ self.w3[e])  # (n_e, hidden)
            out.index_add_(0, tok, (h @ self.w2[e]) * gates[tok, k].unsqueeze(-1).to(x.dtype))
        return out.reshape(shape)


class ExpertTable(nn.Module):
    def __init__(self, n_experts: int, dim: int):
        super().__init__()
        self.down = nn.Parameter(torch.zeros(n_experts, dim))  # u: (N, dim)
        self.up = nn.Parameter(torch.zeros(n_experts, dim))  # v: (N, dim)


def _dots(table: torch.Tensor, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """table (N, dim), idx (T, K), x (T, dim) of table's dtype -> (T, K): table[idx[t, k]] . x[t],
    each dot by the kernel memlm's row_dots takes, so the sums are memlm's bit for bit."""
    tokens, k = idx.shape
    if table.device.type == "cpu":
        # memlm (memory/fast/bag_grad.py weight_gradients): the per-sample-weights backward of
        # embedding_bag, a BLAS dot per read, without gathering (T, K, dim).
        flat = idx.reshape(-1)
        offsets = torch.arange(0, tokens * k, k, dtype=flat.dtype)
        bag = torch.arange(tokens).repeat_interleave(k).to(flat.dtype)
        try:
            return torch.ops.aten._embedding_bag_per_sample_weights_backward(
                x, table, flat, offsets, bag, 0, -1).view(tokens, k)
        except (AttributeError, RuntimeError, TypeError):
            pass
    compute = torch.promote_types(table.dtype, torch.float32)  # memlm's gathered_dots: a batched matmul
    return torch.bmm(table[idx].to(compute), x.to(compute).unsqueeze(-1)).squeeze(-1)


class _RowDots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table, idx, x):
        ctx.save_for_backward(table, idx, x)
        return _dots(table.detach(), idx, x.detach().to(table.dtype).contiguous())

    @staticmethod
    def backward(ctx, grad):
        table, idx, x = ctx.saved_tensors
        grad_table = grad_x = None
        if ctx.needs_input_grad[2]:
            grad_x = F.embedding_bag(idx, table, per_sample_weights=grad.to(table.dtype), mode="sum").to(x.dtype)
        if ctx.needs_input_grad[0]:
            reads = (grad.unsqueeze(-1) * x.unsqueeze(1).to(grad.dtype)).flatten(0, 1)  # (T*K, dim)
            grad_table = torch.zeros_like(table).index_add_(0, idx.reshape(-1), reads.to(table.dtype))
        return grad_table, None, grad_x


def _aligned(table: torch.Tensor) -> torch.Tensor:
    """The table, moved once to memory aligned as torch allocates it (64 bytes on CPU). A
    safetensors file maps tensors at any offset, and the CPU's BLAS dots split their sums by
    the data's alignment: a table read where it was mapped gives other last bits than memlm's."""
    if table.device.type == "cpu" and table.data_ptr() % 64:
        with torch.no_grad():
            table.data = table.data.clone()
    return table


def row_dots(table: torch.Tensor, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """table (N, dim), idx (T, K), x (T, dim) -> (T, K): table[idx[t, k]] . x[t] (memlm memory/fast/row_dots.py)."""
    return _RowDots.apply(_aligned(table), idx, x).to(torch.promote_types(table.dtype, x.dtype))


class PEER(nn.Module):
    """Product-key retrieval of single-neuron experts (memlm model/peer.py)."""

    def __init__(self, dim: int, m: dict):
        super().__init__()
        self.dim, self.n_keys, self.heads, self.knn, self.k_dim = dim, m["n_keys"], m["heads"], m["knn"], m["k_dim"]
        self.query_norm, self.activation = m["qk_norm"], m["peer_activation"]
        self.query = nn.Linear(dim, self.heads * self.k_dim, bias=False)
        self.keys = nn.Parameter(torch.zeros(2, self.n_keys, self.k_dim // 2))  # shared by the heads
        self.experts = ExpertTable(self.n_keys**2, dim)

    def retrieve(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, dim) -> weights (T, H, knn) float32+, expert indices (T, H, knn).

        As memlm's PEER: the query projection too in float32 (or wider) with
        autocast off, so the selection is the float32 model's."""
        weight = self.query.weight  # (H * k_dim, dim)
        compute = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
        with _full_precision(x.device):
            q = F.linear(x.to(compute), weight.to(compute)).view(-1, self.heads, 2, self.k_dim // 2)
            if self.query_norm:
                q = F.rms_norm(q, (self.k_dim // 2,))
            sub = torch.einsum("thcd,cnd->thcn", q, self.keys.to(compute))  # (T, H, 2, n_keys)
            scores, idx = product_key_topk(sub, self.knn)
            return scores.softmax(dim=-1), idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.dim)  # (T, dim)
        weights, idx = self.retrieve(x)  # (T, H, knn) each
        idx = idx.flatten(1)  # (T, H*knn)
        # u_i . x of each retrieved expert; the (T, H*knn, dim) gather is fine at inference.
        hidden = ACTIVATIONS[self.activation](row_dots(self.experts.down, idx, x))  # (T, H*knn)
        coef = weights.flatten(1).to(x.dtype) * hidden  # (T, H*knn)
        out = F.embedding_bag(idx, self.experts.up, per_sample_weights=coef, mode="sum")
        return out.reshape(shape)


# ------------------------------------------------------------------ UltraMemV2
def _rank_sum(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """scores (T, H, r, A), weights (H, r) -> (T, H, A): sum_rho weights[rho] * scores[rho], in rho order."""
    out = scores[:, :, 0] * weights[None, :, 0, None]
    for rho in range(1, scores.shape[2]):
        out = out + scores[:, :, rho] * weights[None, :, rho, None]
    return out


def _bilinear(rows: torch.Tensor, core: torch.Tensor, cols: torch.Tensor, grid: bool) -> torch.Tensor:
    """sum_sig (sum_rho rows[rho] C[rho, sig]) cols[sig]: rows (T, H, r, A), cols (T, H, r, B) ->
    (T, H, A, B) for the grid of every pair, or (T, H, A) for the pairs (rows[a], cols[a]) (A == B)."""
    out = None
    for sig in range(cols.shape[2]):
        left = _rank_sum(rows, core[:, :, sig])
        term = left.unsqueeze(-1) * cols[:, :, sig].unsqueeze(-2) if grid else left * cols[:, :, sig]
        out = term if out is None else out + term
    return out


def tucker_topk(row_scores, col_scores, core, candidates: int, knn: int):
    """UltraMem's TDQKR (memlm memory/ultramem_search.py): the top-`candidates` rows and columns by
    the core's dominant singular pair, then the exact bilinear scores of those pairs and their top-knn.
    row_scores, col_scores (T, H, r, n), core (H, r, r) -> scores, rows, cols (T, H, knn)."""
    U, _, Vh = torch.linalg.svd(core)
    u, t = U[..., :, 0], Vh[..., 0, :]  # (H, r) each
    lead = u.abs().argmax(dim=-1, keepdim=True)
    sign = torch.where(u.gather(-1, lead) < 0, -1.0, 1.0).to(u.dtype)  # u's largest entry positive
    u, t = u * sign, t * sign
    cand_rows = _rank_sum(row_scores, u).topk(candidates, dim=-1)[1]  # (T, H, m)
    cand_cols = _rank_sum(col_scores, t).topk(candidates, dim=-1)[1]

    def keys(scores, idx):  # (T, H, r, n), (T, H, K) -> (T, H, r, K)
        return scores.gather(-1, idx.unsqueeze(2).expand(-1, -1, scores.shape[2], -1))

    grid = _bilinear(keys(row_scores, cand_rows), core, keys(col_scores, cand_cols), grid=True)  # (T, H, m, m)
    best = grid.flatten(-2).topk(knn, dim=-1)[1]  # (T, H, knn)
    rows = cand_rows.gather(-1, torch.div(best, candidates, rounding_mode="floor"))
    cols = cand_cols.gather(-1, best % candidates)
    scores = _bilinear(keys(row_scores, rows), core, keys(col_scores, cols), grid=False)  # (T, H, knn)
    return scores, rows, cols


class TuckerKeys(nn.Module):
    def __init__(self, dim: int, m: dict):
        super().__init__()
        self.heads, self.rank, self.k_dim, self.n_keys = m["heads"], m["rank"], m["k_dim"], m["n_keys"]
        self.knn, self.candidates = m["knn"], m["candidates"]
        self.query = nn.Linear(dim, self.heads * 2 * self.rank * self.k_dim, bias=False)
        self.keys = nn.Parameter(torch.zeros(self.heads, 2, self.rank, self.n_keys, self.k_dim))
        self.query_scale = nn.Parameter(torch.ones(self.heads, 2, self.rank, self.k_dim))
        self.key_scale = nn.Parameter(torch.ones(self.heads, 2, self.rank, self.k_dim))
        self.core = nn.Parameter(torch.zeros(self.heads, self.rank, self.rank))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, dim) -> scores (T, H, knn) float32+, grid addresses i * n + j (T, H, knn)."""
        weight = self.query.weight
        compute = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
        with _full_precision(x.device):
            q = F.linear(x.to(compute), weight.to(compute)).view(-1, self.heads, 2, self.rank, self.k_dim)
            q = F.rms_norm(q, (self.k_dim,)) * self.query_scale.to(compute)
            keys = F.rms_norm(self.keys.to(compute), (self.k_dim,)) * self.key_scale.to(compute)[:, :, :, None]
            s = torch.einsum("thcd,hcnd->thcn", q.flatten(2, 3), keys.flatten(1, 2))
            s = s.view(-1, self.heads, 2, self.rank, self.n_keys)
            scores, rows, cols = tucker_topk(s[:, :, 0], s[:, :, 1], self.core.to(compute), self.candidates, self.knn)
        return scores, rows * self.n_keys + cols


class PreValueTable(nn.Module):
    def __init__(self, n_rows: int, pre_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_rows, pre_dim))


class UltraMem(nn.Module):
    """UltraMemV2's layer (memlm memory/ultramem.py): W_v sum_s score_s (P[s] . W_pre x) V[s]."""

    def __init__(self, dim: int, m: dict):
        super().__init__()
        self.dim, self.expansion = dim, m["expansion"]
        n_rows = m["n_keys"] ** 2 // self.expansion
        self.lookup = TuckerKeys(dim, m)
        self.pre_proj = nn.Linear(dim, m["pre_dim"], bias=False)
        self.pre_values = PreValueTable(n_rows, m["pre_dim"])
        self.value_proj = nn.Linear(m["v_dim"], dim, bias=False)
        self.values = ValuePool(n_rows, m["v_dim"], VALUE_DTYPES[m["value_dtype"]])
        if self.expansion > 1:  # the export holds the grid-address -> row map memlm trained with
            self.register_buffer("address_rows", torch.zeros(m["n_keys"] ** 2, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.dim)  # (T, dim)
        scores, addresses = self.lookup(x)  # (T, H, knn) each
        rows = (addresses if self.expansion == 1 else self.address_rows[addresses]).flatten(1)  # (T, H*knn)
        h = row_dots(self.pre_values.weight, rows, self.pre_proj(x))  # (T, H*knn)
        y = self.values.read(rows, scores.flatten(1).to(h.dtype) * h).to(x.dtype)  # (T, v_dim)
        return self.value_proj(y).reshape(shape)


class UltraMemFFN(nn.Module):
    """The layer beside a SwiGLU of the dense width times memory.ffn_fraction (memlm model/ultramem_ffn.py)."""

    def __init__(self, dim: int, intermediate_size: int, m: dict):
        super().__init__()
        self.memory = UltraMem(dim, m)
        hidden = int(round(intermediate_size * m["ffn_fraction"]))
        self.ffn = SwiGLU(dim, hidden) if hidden else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.memory(x)
        return out if self.ffn is None else out + self.ffn(x)


# ------------------------------------------------------------------ model
class Block(nn.Module):
    def __init__(self, config: MemlmConfig, layer_id: int, feed_forward: nn.Module):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = feed_forward
        engram = config.engram
        self.engram = Engram(config.hidden_size, config.vocab_size, engram, layer_id) \
            if layer_id in engram.get("layers", ()) else None

    def forward(self, x, cos, sin, cache, mask, engram_in=None):
        if self.engram is not None:  # engram_in: (input_ids, real positions or None, the cache's history)
            ids, real, histories = engram_in
            history = None if histories is None else histories.setdefault(self.layer_id, {})
            x = x + self.engram(x, self.engram.hash.canonical(ids, real), real, history)
        h = x + self.attention(self.attention_norm(x), cos, sin, cache, self.layer_id, mask)
        return h + self.feed_forward(self.ffn_norm(h))


def _memory_settings(config: MemlmConfig) -> dict:
    needed = MEMORY_KEYS + (ULTRAMEM_KEYS if "ultramem" in config.layer_ffn_kinds else ())
    missing = [k for k in needed if k not in config.memory]
    if missing and any(kind != "dense" for kind in config.layer_ffn_kinds):
        raise ValueError(f"config.json `memory` lacks {missing}: re-export the model with memlm")
    return config.memory


class MemlmForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MemlmConfig
    base_model_prefix = ""
    _no_split_modules = ["Block"]
    _supports_sdpa = True

    def __init__(self, config: MemlmConfig):
        super().__init__(config)
        dim = config.hidden_size
        m = _memory_settings(config)
        self.tok_embeddings = nn.Embedding(config.vocab_size, dim)
        pool = None
        if m.get("share_values") and any(k in PRODUCT_KEY_KINDS for k in config.layer_ffn_kinds):
            pool = ValuePool(m["n_keys"] ** 2, m["v_dim"], VALUE_DTYPES[m["value_dtype"]])
        self.layers = nn.ModuleList(
            Block(config, i, self._ffn(kind, config, m, pool)) for i, kind in enumerate(config.layer_ffn_kinds)
        )
        # The shared value pool, registered once (memlm's state-dict name: shared.memory_values.weight).
        self.shared = nn.ModuleDict({"memory_values": pool} if pool is not None else {})
        self.norm = RMSNorm(dim, config.rms_norm_eps)
        self.output = None if config.tie_word_embeddings else nn.Linear(dim, config.vocab_size, bias=False)
        self.post_init()

    @staticmethod
    def _ffn(kind: str, config: MemlmConfig, m: dict, pool: ValuePool | None) -> nn.Module:
        dim = config.hidden_size
        if kind == "dense":
            return SwiGLU(dim, config.intermediate_size)
        if kind == "moe":
            return MoE(dim, m)
        if kind == "peer":
            return PEER(dim, m)
        if kind == "ultramem":
            return UltraMemFFN(dim, config.intermediate_size, m)
        dense = SwiGLU(dim, config.intermediate_size) if m["placement"] == "parallel" else None
        return MemoryFFN(ProductKeyMemory(dim, m, kind == "memplus", pool), dense)

    def _init_weights(self, module: nn.Module) -> None:
        # Only for weights a checkpoint lacks (a fresh model): memlm's exports hold every weight.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def get_input_embeddings(self) -> nn.Module:
        return self.tok_embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.tok_embeddings = value

    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def _reorder_cache(self, cache, beam_idx: torch.LongTensor):
        """Beam search's reordering (generate calls it when the model has it): the attention cache's rows
        and every Engram layer's history (canonical ids, conv inputs) follow the surviving beams."""
        cache.reorder_cache(beam_idx)
        for history in cache.__dict__.get(ENGRAM_HISTORY, {}).values():
            for key, past in history.items():  # (batch * beams, positions, ...)
                history[key] = past.index_select(0, beam_idx.to(past.device))
        return cache

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        past_key_values=None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """input_ids (batch, seq) -> logits (batch, seq, vocab), with the cache filled when use_cache."""
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        h = self.tok_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        bsz, seq = h.shape[:2]
        start = cache.get_seq_length() if cache is not None else 0
        padded = attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all())
        if position_ids is None:
            if padded:  # positions count real tokens (left padding), as in Hugging Face's Llama
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -seq:]
            else:
                position_ids = torch.arange(start, start + seq, device=h.device).unsqueeze(0)
        if int(position_ids.max()) >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {int(position_ids.max())} exceeds "
                f"max_position_embeddings={self.config.max_position_embeddings}"
            )
        cos, sin = rope_cos_sin(position_ids.expand(bsz, -1), self.config.head_dim, self.config.rope_theta)
        mask = None
        if padded:
            kv_len = attention_mask.shape[1]
            q_pos = torch.arange(kv_len - seq, kv_len, device=h.device)[:, None]
            k_pos = torch.arange(kv_len, device=h.device)[None, :]
            # Causal and not padding. Every query also sees itself: a padding row
            # then has one key, whatever an SDPA backend does with empty rows.
            mask = ((k_pos <= q_pos) & attention_mask.bool()[:, None, None, :]) | (k_pos == q_pos)
        engram_in = None
        if self.config.engram.get("layers"):
            if input_ids is None:
                raise ValueError("a model with Engram layers needs input_ids (its n-grams hash the token ids)")
            real = attention_mask.bool()[:, -seq:] if padded else None
            # Each Engram layer's canonical ids and conv inputs so far ride on the cache object.
            histories = None if cache is None else cache.__dict__.setdefault(ENGRAM_HISTORY, {})
            engram_in = (input_ids, real, histories)
        for block in self.layers:
            h = block(h, cos, sin, cache, mask, engram_in)
        h = self.norm(h)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = h @ self.output_weight().t()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache if use_cache else None})
        return out if return_dict is not False else out.to_tuple()
