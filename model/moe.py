"""Mixture-of-experts FFN (kind "moe"): top-k routed SwiGLU experts.

The MoE baseline of the memory-layer ablation table (MEMORY_LAYERS.md
section 4). Each token is sent to the `top_k` experts with the highest router
probability; its output is the gate-weighted sum of those experts' SwiGLU
outputs.

Choices, and why:
- Router softmax in float32 (or wider when the input is wider): the router's
  logits are small differences between large numbers, and top-k on bf16
  probabilities produces many ties.
- Gate weights are the softmax probabilities of the chosen experts,
  renormalized to sum to 1 over the `top_k` (Mixtral-style). The output scale
  then does not depend on how peaked the router is, which keeps a top-k MoE a
  drop-in replacement for a dense FFN; the router still gets gradient through
  the relative weights of the chosen experts and through the balance loss.
  With top_k = 1 the gate is therefore always 1 and the router learns only
  from the balance loss (as in every renormalized top-1 router).
- No token dropping and no capacity factor: token-expert assignments are
  sorted by expert and each expert runs on its contiguous slice, so every
  token reaches all of its top_k experts however unbalanced the routing is.
  The slices are computed by one grouped GEMM per projection
  (`F.grouped_mm`, group ends = cumulative per-expert counts, kept on the
  device): no host sync. Where grouped_mm does not apply (CUDA in a dtype
  other than bf16, or dim / hidden size not a multiple of 16 bytes), a loop
  over the experts does the same math, reading the counts on the host (one
  sync per layer).
- Load balancing (Switch/GShard): aux = coef * E * sum_e f_e * P_e, where f_e
  is the fraction of the T*top_k token-slot assignments routed to e and P_e is
  the mean router probability of e. It equals `coef` for perfectly uniform
  routing. Stored in `self.last_aux_loss` (the Transformer's aux-loss channel).
- Expert hidden size: `memory.expert_hidden_dim`, or by default the dense
  SwiGLU hidden size divided by top_k (at least 1). A token then runs top_k
  experts of hidden/top_k channels, i.e. the same expert FLOPs as the dense
  FFN it replaces, plus the (small) router: compute-matched, while total
  parameters grow by n_experts / top_k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memlm.errors import ConfigError
from memlm.memory.search import full_precision
from memlm.model.ffn import FFNContext, register_ffn


class MoE(nn.Module):
    def __init__(
        self, dim: int, hidden_dim: int, n_experts: int, top_k: int, balance_loss_coef: float = 0.0
    ):
        super().__init__()
        if n_experts < 1:
            raise ConfigError("memory.n_experts", n_experts, "an integer >= 1")
        if not 1 <= top_k <= n_experts:
            raise ConfigError("memory.top_k", top_k, f"an integer in [1, memory.n_experts={n_experts}]")
        if hidden_dim < 1:
            raise ConfigError("memory.expert_hidden_dim", hidden_dim, "a positive integer")
        self.dim, self.hidden_dim = dim, hidden_dim
        self.n_experts, self.top_k = n_experts, top_k
        self.balance_loss_coef = balance_loss_coef
        self.router = nn.Linear(dim, n_experts, bias=False)
        # Experts stacked along dim 0 so one tensor holds each projection of
        # all experts (one FSDP shard, one init call). SwiGLU per expert:
        # w2[e]^T (silu(w1[e]^T x) * w3[e]^T x).
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))  # (E, dim, hidden) gate
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))  # (E, dim, hidden) up
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))  # (E, hidden, dim) down
        self.last_aux_loss: torch.Tensor | None = None

    # --------------------------------------------------------------- routing
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (T, dim) -> probs (T, E) float32+, gates (T, top_k), experts (T, top_k) int64."""
        compute = torch.promote_types(x.dtype, torch.float32)
        with full_precision(x.device):  # float32 even under autocast(bf16)
            logits = F.linear(x.to(compute), self.router.weight.to(compute))  # (T, E)
            probs = logits.softmax(dim=-1)
            top_p, experts = probs.topk(self.top_k, dim=-1)  # (T, k) each
        gates = top_p / top_p.sum(dim=-1, keepdim=True)
        return probs, gates, experts

    def balance_loss(self, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """probs: (T, E), experts: (T, top_k) -> coef * E * sum_e f_e * P_e (scalar)."""
        counts = torch.bincount(experts.reshape(-1), minlength=self.n_experts)  # (E,)
        f = counts.to(probs.dtype) / experts.numel()  # no gradient: a count
        p = probs.mean(dim=0)  # (E,)
        return self.balance_loss_coef * self.n_experts * (f * p).sum()

    # --------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, seq, dim) -> (batch, seq, dim)
        shape = x.shape
        x = x.reshape(-1, self.dim)  # (T, dim)
        probs, gates, experts = self.route(x)
        flat_experts = experts.reshape(-1)  # (T*k,) assignment a -> token a // k
        # Stable sort keeps tokens in order within an expert (deterministic).
        order = torch.argsort(flat_experts, stable=True)  # (T*k,)
        token_of = order // self.top_k  # (T*k,) token index of each sorted assignment
        counts = torch.bincount(flat_experts, minlength=self.n_experts)  # (E,)
        routed = x[token_of]  # (T*k, dim), grouped by expert
        if self.grouped_mm_applies(x):
            y = self.experts_grouped(routed, counts)
        else:
            y = self.experts_loop(routed, counts)
        y = y * gates.reshape(-1)[order].unsqueeze(-1).to(x.dtype)  # (T*k, dim)
        out = torch.zeros_like(x).index_add_(0, token_of, y)  # (T, dim)
        self.last_aux_loss = self.balance_loss(probs, experts) if self.balance_loss_coef > 0 else None
        return out.reshape(shape)

    def grouped_mm_applies(self, x: torch.Tensor) -> bool:
        """F.grouped_mm runs on CPU (float dtypes) and on CUDA in bf16, with
        row strides that are multiples of 16 bytes."""
        if not hasattr(F, "grouped_mm"):
            return False
        if x.device.type == "cuda":
            dtype_ok = x.dtype == torch.bfloat16
        else:
            dtype_ok = x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
        align = 16 // x.element_size()
        return dtype_ok and self.dim % align == 0 and self.hidden_dim % align == 0

    def experts_grouped(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """routed: (T*k, dim) sorted by expert, counts: (E,) -> (T*k, dim); no host read."""
        ends = torch.cumsum(counts, 0, dtype=torch.int32)  # (E,) end of each expert's rows

        def grouped(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return _ContiguousGrad.apply(F.grouped_mm(a, w.to(a.dtype), offs=ends))

        h = F.silu(grouped(routed, self.w1)) * grouped(routed, self.w3)  # (T*k, hidden)
        return grouped(h, self.w2)  # (T*k, dim)

    def experts_loop(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The same as experts_grouped, one expert at a time (reads counts on the host)."""
        outs = []
        for e, chunk in enumerate(routed.split(counts.tolist())):
            # chunk: (count_e, dim); an empty chunk gives an empty output.
            h = F.silu(chunk @ self.w1[e]) * (chunk @ self.w3[e])  # (count_e, hidden)
            outs.append(h @ self.w2[e])  # (count_e, dim)
        return torch.cat(outs)

    # ------------------------------------------------------ init, accounting
    def init_weights(self, init_std: float, out_std: float) -> None:
        # Same convention as SwiGLU: input-side gate at init_std, the rest at
        # the depth-scaled out_std.
        for w, std in ((self.router.weight, init_std), (self.w1, init_std), (self.w3, out_std), (self.w2, out_std)):
            nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def expert_params(self) -> int:
        """Parameters of one expert (w1, w3, w2)."""
        return 3 * self.dim * self.hidden_dim

    def flops_per_token(self) -> int:
        """Router matmul + top_k expert SwiGLUs (3 matmuls each); softmax, top-k,
        gating and the scatter-add are ignored like norms elsewhere."""
        return 2 * self.dim * self.n_experts + self.top_k * 2 * self.expert_params()

    def inactive_params(self) -> int:
        """Parameters of the n_experts - top_k experts a token does not run."""
        return (self.n_experts - self.top_k) * self.expert_params()


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward passes on a contiguous gradient: grouped_mm's
    backward rejects expanded ones (e.g. the gradient of a sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def default_expert_hidden_dim(dense_hidden_dim: int, top_k: int) -> int:
    """Dense SwiGLU hidden size / top_k: top_k experts cost what the dense FFN costs."""
    return max(1, dense_hidden_dim // top_k)


@register_ffn("moe")
def _build_moe(ctx: FFNContext) -> nn.Module:
    cfg = ctx.memory
    if cfg is None:  # model.ffn=moe without a memory section: its defaults
        from memlm.memory.config import MemoryConfig

        cfg = MemoryConfig(kind="moe")
    hidden = cfg.expert_hidden_dim or default_expert_hidden_dim(ctx.args.hidden_dim, max(cfg.top_k, 1))
    return MoE(ctx.args.dim, hidden, cfg.n_experts, cfg.top_k, cfg.balance_loss_coef)
