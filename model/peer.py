"""PEER FFN (kind "peer"): product-key retrieval of single-neuron experts.

He 2024, "Mixture of a Million Experts"; the PEER baseline of the
memory-layer ablation table (docs/baselines.md). There are
N = n_keys**2 experts; expert i is one hidden neuron with a down vector u_i
and an up vector v_i (both of size dim): e_i(x) = act(u_i . x) * v_i.

For each head h (heads share the experts and the sub-keys, as in PEER, and
differ by their query projection):
1. q_h = W_q x, split into halves (k_dim // 2 each);
2. scores of the halves against the two sub-key sets (n_keys each), top-k of
   each half, then top-k of the k*k summed candidate scores: this is the exact
   top-k over all N summed scores, at sqrt(N) cost;
3. w_h = softmax over the k kept scores (float32 or wider);
4. out = sum_h sum_t w_h[t] * act(u_{i_t} . x) * v_{i_t}.

Choices, and why:
- act = GELU by default (PEER's choice); "silu" is available via the
  constructor.
- Optional query normalization (`memory.qk_norm`): PEER normalizes queries with
  BatchNorm; we use a parameter-free RMSNorm of each query half, which also
  fixes the query scale but does not depend on the batch (so it behaves the
  same in training, evaluation and under any data parallelism).
- The u and v tables live in an `ExpertTable` submodule whose
  `param_category` is "memory": they are the large sparse tables (the analogue
  of memory values: each row gets gradient only when read), while the query
  projection and sub-keys are dense. Consequence: `num_params()` counts them
  as memory, and the trainer's optimizer puts them in the memory-value group
  (`memory.value_lr`, `value_weight_decay`, `value_grad_clip`).
- The search is the memory layers' own (`memlm.memory.fast.search_grad.product_key_search`,
  which takes keys shared by the heads), with its backward through the selected
  sub-keys only, and so is its precision rule: the query is projected in IEEE
  float32 with autocast and TF32 off. Under FSDP PEER is no unit of its own,
  so its query weights are gathered in the block's dtype (the memory layers'
  ProductKeys is gathered in float32).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memlm.memory.config import check_lookup_size
from memlm.memory.fast.exact import exact_linear, full_precision
from memlm.memory.fast.row_dots import row_dots
from memlm.memory.fast.search_grad import product_key_search
from memlm.model.family import Family, register_family
from memlm.model.ffn import FFNContext

ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu}


class ExpertTable(nn.Module):
    """The N single-neuron experts: down vectors u (N, dim) and up vectors v (N, dim)."""

    param_category = "memory"  # counted with the sparse tables by Transformer.num_params

    def __init__(self, n_experts: int, dim: int):
        super().__init__()
        self.down = nn.Parameter(torch.empty(n_experts, dim))  # u: (N, dim)
        self.up = nn.Parameter(torch.empty(n_experts, dim))  # v: (N, dim)


class PEER(nn.Module):
    def __init__(
        self,
        dim: int,
        n_keys: int,
        heads: int,
        knn: int,
        k_dim: int,
        query_norm: bool = False,
        activation: str = "gelu",
    ):
        super().__init__()
        check_lookup_size(n_keys, heads, k_dim, knn=knn)  # the memory layers' own check (ValueError)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is invalid: one of {', '.join(ACTIVATIONS)}")
        self.dim, self.n_keys, self.heads, self.knn, self.k_dim = dim, n_keys, heads, knn, k_dim
        self.n_experts = n_keys**2
        self.query_norm = query_norm
        self.activation = activation
        self.query = nn.Linear(dim, heads * k_dim, bias=False)
        self.keys = nn.Parameter(torch.empty(2, n_keys, k_dim // 2))  # (2, n_keys, half)
        self.experts = ExpertTable(self.n_experts, dim)

    def retrieve(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, dim) -> weights (T, H, knn) float32+, expert indices (T, H, knn)."""
        weight = self.query.weight  # (H * k_dim, dim)
        compute = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
        # The product-key lookup's precision rule (memlm.memory.ProductKeys): the
        # query projection, scores, top-k and softmax in IEEE float32 (autocast
        # and TF32 off), so the selection is the float32 model's. (No bias here:
        # a zero one, which adds nothing.)
        with full_precision(x.device):
            q = exact_linear(x.to(compute), weight.to(compute), weight.new_zeros(weight.shape[0], dtype=compute))
            q = q.view(-1, self.heads, 2, self.k_dim // 2)  # (T, H, 2, half)
            if self.query_norm:
                q = F.rms_norm(q, (self.k_dim // 2,))
            # The memory layers' search (keys shared by the heads), unordered: the layer only sums over the winners.
            scores, idx, _ = product_key_search(q, self.keys.to(compute), self.knn, ordered=False)
            return scores.softmax(dim=-1), idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, seq, dim) -> (batch, seq, dim)
        shape = x.shape
        x = x.reshape(-1, self.dim)  # (T, dim)
        weights, idx = self.retrieve(x)  # (T, H, knn) each
        idx = idx.flatten(1)  # (T, H*knn): one bag of H*knn experts per token
        # u_i . x for each retrieved expert, without the (T, H*knn, dim) gather of u rows.
        hidden = ACTIVATIONS[self.activation](row_dots(self.experts.down, idx, x))  # (T, H*knn)
        coef = weights.flatten(1).to(x.dtype) * hidden  # (T, H*knn)
        # Weighted sum of the v rows without materializing the (T, H*knn, dim) gather.
        out = F.embedding_bag(idx, self.experts.up, per_sample_weights=coef, mode="sum")  # (T, dim)
        return out.reshape(shape)

    # ------------------------------------------------------ init, accounting
    def init_weights(self, init_std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.query.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)
        # Sub-keys as in product-key memory; u rows at dim**-0.5 so u.x is O(1)
        # for a normalized x; v rows write into the residual stream: out_std.
        bound = self.k_dim**-0.5
        nn.init.uniform_(self.keys, -bound, bound)
        nn.init.normal_(self.experts.down, mean=0.0, std=self.dim**-0.5)
        nn.init.trunc_normal_(self.experts.up, mean=0.0, std=out_std, a=-3 * out_std, b=3 * out_std)

    def rows_read(self) -> int:
        """Expert rows a token reads (per table); heads may pick the same expert,
        so this is an upper bound on distinct rows."""
        return min(self.heads * self.knn, self.n_experts)

    def flops_per_token(self) -> int:
        """Query projection + sub-key scoring (both halves, every head) + one dot
        (u) and one axpy (v) per read expert. Candidate sums, top-k, softmax and
        the activation are ignored like norms elsewhere."""
        query = 2 * self.dim * self.heads * self.k_dim
        scoring = 2 * self.heads * self.n_keys * self.k_dim  # 2 halves x n_keys x k_dim/2 x 2
        experts = 2 * self.heads * self.knn * self.dim * 2  # u and v rows
        return query + scoring + experts

    def inactive_params(self) -> int:
        """u and v rows of the experts a token does not read."""
        return 2 * (self.n_experts - self.rows_read()) * self.dim


@register_family
class PEERFamily(Family):
    """PEER's expert tables are sparse tables (finetune=memory trains them) kept under FSDP."""

    kind, label = "peer", "PEER"
    holds_tables = product_keys = remote_code = True

    def build(self, ctx: FFNContext) -> nn.Module:
        cfg = ctx.memory
        if cfg is None:  # model.ffn=peer without a memory section: its defaults
            from memlm.memory.config import MemoryConfig

            cfg = MemoryConfig(kind=self.kind)
        return PEER(ctx.args.dim, cfg.n_keys, cfg.heads, cfg.knn, cfg.k_dim, query_norm=cfg.qk_norm)

    def validate(self, memory: Any, prefix: str = "memory") -> None:
        memory.validate_lookup_size(prefix, knn=memory.knn)  # (PEER has one knn: no eval_knn)
