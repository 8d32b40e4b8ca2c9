"""Product-key lookup: which value slots a token reads, and with what weight.

The `ProductKeys` module (query projection + sub-keys) and the slot-balance
loss. The exact search itself, and its sparse backward, are in
memory/fast/search.py and memory/fast/search_grad.py (re-exported here).

    lookup = ProductKeys(dim=512, n_keys=1024, heads=4, knn=32, k_dim=512)
    weights, slots, _ = lookup(x, sub="none")  # x (T, 512) -> (T, 4 * 32) float32 softmax weights, int64 slots

The lookup computes in IEEE float32 whatever the model around it does: the
query projection and the scores with autocast off and TF32 off
(memlm.memory.fast.exact), and, under FSDP, its parameters gathered in float32
(`full_precision_params`, read by memlm.distributed.parallelize). Its selection is
the float32 model's: at n_keys 1024, k_dim 512, knn 32 a bf16 query changes
the selected set of ~20% of the lookups, TF32 scores ~3%
(tests/integration/test_lookup_precision.py). The cost: the forward's query projection in
float32 (2 * dim * heads * k_dim FLOPs per token, at float32 speed).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

try:  # torch >= 2.9
    from torch.fx.experimental.sym_node import DynamicInt
except ImportError:  # pragma: no cover - older torch: knn is a constant, each value compiles once
    DynamicInt = None
from memlm.memory.config import check_lookup_size
from memlm.memory.fast.exact import exact_linear, exact_subkey_scores, full_precision
from memlm.memory.fast.search import product_key_topk, subkey_scores
from memlm.memory.fast.search_grad import product_key_search, topk_of_sub_scores

SUB_MODES = ("detached", "grad", "none")

__all__ = ["ProductKeys", "balance_loss", "product_key_search", "product_key_topk", "subkey_scores"]


def balance_loss(sub_scores: torch.Tensor) -> torch.Tensor:
    """Slot-balance loss: KL(batch-average sub-key distribution || uniform),
    averaged over heads and the two halves. 0 when every sub-key gets the same
    average probability, log(n_keys) when one sub-key takes everything.

    A uniform average over sub-keys of both halves makes the average slot
    distribution uniform too (it is their outer product for independent halves),
    at sqrt(N) cost. sub_scores: (T, H, 2, n_keys) -> scalar float32."""
    n_keys = sub_scores.shape[-1]
    mean_p = sub_scores.float().softmax(dim=-1).mean(dim=0)  # (H, 2, n_keys)
    kl = (mean_p * (mean_p.clamp_min(1e-30).log() + math.log(n_keys))).sum(dim=-1)  # (H, 2)
    return kl.mean()


def _unspecialized(knn: int) -> int:
    """knn as an int that torch.compile traces as a symbol, not a constant
    (torch's DynamicInt, an int subclass: eager code sees a plain int). The
    search op is shape-generic in knn, so a knn schedule runs one compiled
    graph for every value instead of recompiling per value (knn 1 alone is
    specialized by the compiler: one recompile when it moves on)."""
    return knn if DynamicInt is None else DynamicInt(knn)


class ProductKeys(nn.Module):
    """Multi-head query projection + sub-keys; maps tokens to (weights, slots).

    `knn` is used in training mode, `eval_knn` in eval mode (self.training
    decides); both may be changed between steps (see memory/schedule.py)
    without recompiling a compiled model (see _unspecialized)."""

    # Read by memlm.distributed.parallelize: under FSDP this module is a unit of its
    # own whose parameters are all-gathered in float32, not in the compute dtype.
    full_precision_params = True

    def __init__(
        self,
        dim: int,
        n_keys: int,
        heads: int,
        knn: int,
        k_dim: int,
        qk_norm: bool = False,
        eval_knn: int | None = None,
    ):
        super().__init__()
        check_lookup_size(n_keys, heads, k_dim)  # knn and eval_knn: their setters
        self.dim, self.n_keys, self.heads, self.k_dim = dim, n_keys, heads, k_dim
        self.half = k_dim // 2
        self.qk_norm = qk_norm
        self.knn = knn
        self.eval_knn = knn if eval_knn is None else eval_knn
        self.query = nn.Linear(dim, heads * k_dim, bias=True)  # W_q
        self.keys = nn.Parameter(torch.empty(heads, 2, n_keys, self.half))
        self.init_weights()

    # Plain ints to readers; the DynamicInt (see _unspecialized) only reaches
    # the search, through current_knn (it would print as "DynamicInt(32)").
    @property
    def knn(self) -> int:
        return int(self._knn)

    @knn.setter
    def knn(self, value: int) -> None:
        check_lookup_size(self.n_keys, self.heads, self.k_dim, knn=value)
        self._knn = _unspecialized(int(value))

    @property
    def eval_knn(self) -> int:
        return int(self._eval_knn)

    @eval_knn.setter
    def eval_knn(self, value: int) -> None:
        check_lookup_size(self.n_keys, self.heads, self.k_dim, eval_knn=value)
        self._eval_knn = _unspecialized(int(value))

    @property
    def current_knn(self) -> int:
        """The knn of this forward (training or eval), as the int torch.compile traces as a symbol."""
        return self._knn if self.training else self._eval_knn

    def query_and_keys(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, dim) -> query (T, H, 2, half) and sub-keys (H, 2, n_keys, half)
        in float32, or wider if x or the parameters are (float64).

        All of it with autocast off, the projection with TF32 off too
        (exact_linear): under autocast(bf16), or with x in bf16 (an FSDP
        block's activations), the query is still x's exact float32
        projection, so the selection is the float32 model's."""
        weight, bias = self.query.weight, self.query.bias  # (H * k_dim, dim), (H * k_dim,)
        compute = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
        with full_precision(x.device):
            q = exact_linear(x.to(compute), weight.to(compute), bias.to(compute))  # (T, H * k_dim)
            q = q.view(-1, self.heads, 2, self.half)
            keys = self.keys.to(compute)
            if self.qk_norm:
                # QK-norm as in attention: unit-RMS query halves and sub-key rows,
                # dot product over sqrt(half), so the scores are sqrt(half) * cosine
                # whatever the scale the query projection drifts to. The 1/sqrt(half)
                # goes on the (small) query, not on the (T, H, 2, n_keys) scores.
                q = F.rms_norm(q, (self.half,)) * self.half**-0.5
                keys = F.rms_norm(keys, (self.half,))
        return q, keys

    def sub_scores(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, dim) -> sub-key scores (T, H, 2, n_keys), differentiable (dense), float32+."""
        q, keys = self.query_and_keys(x)
        with full_precision(x.device):
            return exact_subkey_scores(q, keys)

    def forward(
        self, x: torch.Tensor, sub: str = "detached"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x (T, dim) -> weights (T, H*knn) softmax per head in float32 (or
        wider, also under autocast), slots (T, H*knn) int64, sub-key scores (T, H, 2, n_keys).

        `sub` says what the sub-key scores are for: "detached" (default: for
        metrics), "grad" (differentiable: a loss on them, e.g. the balance
        loss) or "none" (not needed: None is returned, and the search may run
        in chunks of tokens). Except with "grad", the search's backward
        touches only the selected sub-keys (memory/fast/search_grad.py); with "grad"
        the gradient goes through autograd's dense path, which a loss on the
        sub-scores needs anyway."""
        if sub not in SUB_MODES:
            raise ValueError(f"sub must be one of {SUB_MODES}, got {sub!r}")
        q, keys = self.query_and_keys(x)
        # Scores, top-k and softmax in float32 (or wider) whatever autocast says.
        with full_precision(x.device):
            if sub == "grad":
                sub_scores = exact_subkey_scores(q, keys)
                scores, slots = topk_of_sub_scores(sub_scores, self.current_knn, ordered=False)  # (T, H, knn) each
            else:
                scores, slots, sub_scores = product_key_search(
                    q, keys, self.current_knn, keep_sub=sub == "detached", ordered=False
                )
            # softmax itself, so the weights equal the plain formulation's (Meta's layer,
            # the exported remote code) bit for bit: exp(s - logsumexp(s)) differs in the
            # last bits (tests/unit/test_memory_exact.py). Then a fresh (T, H*knn) tensor,
            # not flatten's view: a view returned by an FSDP unit (this module is one;
            # memlm.distributed.parallelize) makes FSDP2 warn every step.
            weights = scores.softmax(dim=-1).flatten(1).clone()
        return weights, slots.flatten(1), sub_scores

    @torch.no_grad()
    def init_weights(self) -> None:
        # Published init: sub-keys uniform in +-1/sqrt(k_dim), W_q xavier-uniform.
        bound = self.k_dim**-0.5
        nn.init.uniform_(self.keys, -bound, bound)
        nn.init.xavier_uniform_(self.query.weight)
        nn.init.zeros_(self.query.bias)

    def flops_per_token(self) -> int:
        """Query projection, sub-key scoring (every head, both halves) and the
        knn*knn candidate sums per head."""
        query = 2 * self.dim * self.heads * self.k_dim
        scoring = 2 * self.heads * self.n_keys * self.k_dim  # 2 halves x n_keys x half x 2
        candidates = self.heads * self.knn * self.knn
        return query + scoring + candidates

    def extra_repr(self) -> str:
        return (
            f"n_keys={self.n_keys}, heads={self.heads}, knn={self.knn}, eval_knn={self.eval_knn}, "
            f"k_dim={self.k_dim}, qk_norm={self.qk_norm}"
        )
