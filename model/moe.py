"""Mixture-of-experts FFN (kind "moe"): top-k routed SwiGLU experts.

The MoE baseline of the memory-layer ablation table (docs/baselines.md). Each
token is sent to the `top_k` experts with the highest router probability; its
output is the gate-weighted sum of those experts' SwiGLU outputs.

    moe = MoE(dim=4096, hidden_dim=7168, n_experts=8, top_k=2, balance_loss_coef=0.01)
    y = moe(x)                                       # x (batch, seq, dim) -> (batch, seq, dim)
    moe.last_aux_loss                                # the balance loss of that forward, or None
    expert_path(torch.device("cuda", 0), torch.bfloat16, 4096, 7168)  # "grouped" on an H200

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
- No token dropping and no capacity factor: every token reaches all of its
  top_k experts however unbalanced the routing is.
- No host read and no data-dependent shape anywhere in the layer: tokens per
  expert are counted with a fixed-size scatter-add into (E,) (not
  torch.bincount, whose output size depends on the data: a host sync on CUDA,
  graph breaks under torch.compile, no meta kernel), and the experts run in
  one of two sync-free formulations chosen by `expert_path` (device, compute
  dtype, sizes; a pure function, tested directly):
  "grouped": token-expert assignments sorted by expert, one grouped GEMM per
  projection (`F.grouped_mm`, group ends = cumulative counts kept on the
  device). The fast path on a GPU: CUDA in bf16 on sm90/sm100 (H100, H200,
  B200), where torch has the CUTLASS kernel (elsewhere its CUDA fallback
  copies the offsets to the host); also bf16 on CPU and meta, and fp32 on CPU
  in eager mode (the fake kernel torch.compile traces with is bf16-only).
  "dense": every expert on every token, then the top_k outputs gathered:
  the same math at n_experts / top_k times the expert FLOPs, for what grouped
  GEMMs do not cover (fp32 on CUDA, fp64, dims not a multiple of 16 bytes).
- Compute dtype: the matmuls run in the autocast dtype when autocast is on
  (single-process bf16 training: the residual stream reaching the layer is
  fp32, and bf16 is what selects the grouped GEMM on a GPU), else in the
  input's dtype (FSDP's bf16 policy hands the block bf16). Gate weighting and
  the sum over a token's experts run in float32 (or wider), and the output
  comes back in the input's dtype.
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

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memlm.errors import ConfigError
from memlm.memory.fast.exact import autocast_available, full_precision
from memlm.model.family import Family, register_family
from memlm.model.ffn import FFNContext

GROUPED, DENSE = "grouped", "dense"


def _grouped_mm_op():
    """F.grouped_mm, or torch._grouped_mm where F.grouped_mm is not public
    yet (the same op; older torch on a GPU machine), or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@torch.compiler.assume_constant_result
def _cuda_has_grouped_gemm(index: int | None) -> bool:
    """Whether CUDA device `index` (None: the current one) runs torch's CUTLASS grouped GEMM: sm90 and
    sm100 (H100, H200, B200). On other GPUs torch's grouped_mm falls back to a
    loop that copies the group offsets to the host. A constant under
    torch.compile (read once at trace time)."""
    return torch.cuda.get_device_capability(index)[0] in (9, 10)


def expert_path(device: torch.device, dtype: torch.dtype, dim: int, hidden_dim: int) -> str:
    """The formulation MoE.forward uses for matmuls in `dtype` on `device`:
    GROUPED (one grouped GEMM per projection, expert FLOPs only) or DENSE
    (every expert on every token, n_experts / top_k times the FLOPs). Both are
    free of host reads; GROUPED wherever torch's grouped_mm is sync-free and
    traceable:
    - CUDA: bf16 on sm90/sm100 (the CUTLASS kernel). The single-process bf16
      step (autocast) and FSDP's bf16 policy both reach this with bf16.
    - meta: bf16 (its kernel carries the CUDA checks).
    - CPU: bf16; fp32 in eager mode only (torch.compile traces the op with
      the bf16-only fake kernel).
    - and the rows of both operands 16-byte aligned (dim, hidden_dim)."""
    if _grouped_mm_op() is None or not dtype.is_floating_point:
        return DENSE
    align = 16 // dtype.itemsize
    if dim % align or hidden_dim % align:
        return DENSE
    if device.type == "cuda":
        return GROUPED if dtype == torch.bfloat16 and _cuda_has_grouped_gemm(device.index) else DENSE
    if device.type == "meta":
        return GROUPED if dtype == torch.bfloat16 else DENSE
    if device.type == "cpu" and getattr(F, "grouped_mm", None) is not None:
        if dtype == torch.bfloat16 or (dtype == torch.float32 and not torch.compiler.is_compiling()):
            return GROUPED
    return DENSE


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the expert matmuls run in: autocast's when it is on for x's
    device and x is float32 (what autocast would cast), else x's own."""
    kind = x.device.type
    if x.dtype == torch.float32 and autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def expert_counts(flat_experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """flat_experts: (A,) int64 in [0, n_experts) -> (n_experts,) int64 tokens
    per expert. A scatter-add into a fixed-size tensor: no data-dependent
    shape (unlike torch.bincount), so no host read and no graph break."""
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat_experts.device)
    return counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))


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

    def balance_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """probs: (T, E), counts: (E,) assignments per expert -> coef * E * sum_e f_e * P_e (scalar)."""
        f = counts.to(probs.dtype) / (probs.shape[0] * self.top_k)  # (E,) no gradient: a count
        p = probs.mean(dim=0)  # (E,)
        return self.balance_loss_coef * self.n_experts * (f * p).sum()

    # --------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, seq, dim) -> (batch, seq, dim), in x's dtype
        shape, out_dtype = x.shape, x.dtype
        x = x.reshape(-1, self.dim)  # (T, dim)
        probs, gates, experts = self.route(x)  # (T, E), (T, k), (T, k)
        counts = expert_counts(experts.reshape(-1), self.n_experts)  # (E,)
        dtype = compute_dtype(x)
        xc = x.to(dtype)  # (T, dim) in the matmuls' dtype
        if expert_path(x.device, dtype, self.dim, self.hidden_dim) == GROUPED:
            out = self.experts_grouped(xc, gates, experts, counts)
        else:
            out = self.experts_dense(xc, gates, experts)
        self.last_aux_loss = self.balance_loss(probs, counts) if self.balance_loss_coef > 0 else None
        return out.to(out_dtype).reshape(shape)

    def experts_grouped(
        self, x: torch.Tensor, gates: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """x: (T, dim), gates (T, k), experts (T, k), counts (E,) -> (T, dim)
        float32+: assignments sorted by expert, one grouped GEMM per projection."""
        flat_experts = experts.reshape(-1)  # (T*k,) assignment a -> token a // k
        # Stable sort keeps tokens in order within an expert (deterministic).
        order = torch.argsort(flat_experts, stable=True)  # (T*k,)
        token_of = order // self.top_k  # (T*k,) token index of each sorted assignment
        routed = x[token_of]  # (T*k, dim), grouped by expert
        ends = torch.cumsum(counts, 0, dtype=torch.int32)  # (E,) end of each expert's rows
        grouped_mm = _grouped_mm_op()

        def grouped(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return _ContiguousGrad.apply(grouped_mm(a, w.to(a.dtype), offs=ends))

        h = F.silu(grouped(routed, self.w1)) * grouped(routed, self.w3)  # (T*k, hidden)
        y = grouped(h, self.w2)  # (T*k, dim)
        acc = torch.promote_types(x.dtype, torch.float32)
        y = y.to(acc) * gates.reshape(-1)[order].unsqueeze(-1).to(acc)  # (T*k, dim)
        return torch.zeros(x.shape, dtype=acc, device=x.device).index_add_(0, token_of, y)  # (T, dim)

    def experts_dense(self, x: torch.Tensor, gates: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The same as experts_grouped by running every expert on every token
        and gathering each token's top_k outputs: fixed shapes, any dtype,
        n_experts / top_k times the expert FLOPs and (E, T, hidden) activations."""
        w1, w3, w2 = (w.to(x.dtype) for w in (self.w1, self.w3, self.w2))
        h = F.silu(torch.matmul(x, w1)) * torch.matmul(x, w3)  # (E, T, hidden)
        y = torch.bmm(h, w2)  # (E, T, dim)
        tokens = torch.arange(x.shape[0], device=x.device).unsqueeze(-1)  # (T, 1)
        chosen = y[experts, tokens]  # (T, k, dim): expert experts[t, j] on token t
        acc = torch.promote_types(x.dtype, torch.float32)
        return (chosen.to(acc) * gates.unsqueeze(-1).to(acc)).sum(dim=1)  # (T, dim)

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


@register_family
class MoEFamily(Family):
    kind, label = "moe", "MoE"
    remote_code = True

    def build(self, ctx: FFNContext) -> nn.Module:
        cfg = ctx.memory
        if cfg is None:  # model.ffn=moe without a memory section: its defaults
            from memlm.memory.config import MemoryConfig

            cfg = MemoryConfig(kind=self.kind)
        hidden = cfg.expert_hidden_dim or default_expert_hidden_dim(ctx.args.hidden_dim, max(cfg.top_k, 1))
        return MoE(ctx.args.dim, hidden, cfg.n_experts, cfg.top_k, cfg.balance_loss_coef)

    def validate(self, memory: Any, prefix: str = "memory") -> None:
        if memory.n_experts < 1:
            raise ConfigError(f"{prefix}.n_experts", memory.n_experts, "an integer >= 1")
        if not 1 <= memory.top_k <= memory.n_experts:
            raise ConfigError(f"{prefix}.top_k", memory.top_k,
                              f"an integer in [1, memory.n_experts={memory.n_experts}]")
        if memory.expert_hidden_dim < 0:
            raise ConfigError(f"{prefix}.expert_hidden_dim", memory.expert_hidden_dim,
                              "0 (dense hidden size // top_k) or a positive integer")
        if memory.balance_loss_coef < 0:
            raise ConfigError(f"{prefix}.balance_loss_coef", memory.balance_loss_coef, "a number >= 0")
