"""`Memory` (plain product-key memory) and `MemoryPlus` (the paper's best variant).

Both map (..., dim) -> (..., dim) and work in any PyTorch model:

    mem = MemoryPlus(dim=512, n_keys=256, heads=4, knn=32, k_dim=512)
    y = mem(x)  # x: (batch, seq, 512)

The read (docs/memory.md, "The math, as implemented"), per token:
    weights, slots = product-key top-k per head (softmax in float32)
    y = sum over the H*knn reads of weight * V[slot]        (memory.fast.ops.embedding_bag)
    Memory:     out = y, or W_o y with an output projection
    MemoryPlus: out = W2(y * silu(W1 x))   (gate "swilu"; "sigmoid": sigmoid(W1 x); "none": W2 y)
                with bias=True (memory.w_bias): W2(y * silu(W1 x + b1)) + b2

The value table lives in a `ValuePool`. Pass `values=pool` to share one pool
between layers (Memory+); the caller then registers the pool once on a
common parent. Without `values`, the layer creates and owns its own pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memlm.memory.config import GATES, KERNELS, check_choice
from memlm.memory.fast.launches import NO_LAUNCHES, ReadLaunches
from memlm.memory.fast.ops import resolve_kernel
from memlm.memory.product_keys import ProductKeys, balance_loss
from memlm.memory.usage import SlotUsage
from memlm.memory.values import ValuePool


class ProductKeyMemory(nn.Module):
    """What both variants share: lookup, value pool, read, usage, aux loss."""

    def __init__(
        self,
        dim: int,
        n_keys: int = 1024,
        heads: int = 4,
        knn: int = 32,
        k_dim: int = 512,
        v_dim: int | None = None,
        values: ValuePool | None = None,
        qk_norm: bool = False,
        eval_knn: int | None = None,
        balance_loss_coef: float = 0.0,
        sparse_updates: bool = False,
        kernel: str = "auto",
        launches: ReadLaunches = NO_LAUNCHES,
        layer_id: int | None = None,
        value_init_scale: float = 1.0,
        value_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        v_dim = v_dim or dim
        self.dim, self.v_dim = dim, v_dim
        self.layer_id = layer_id  # names this layer in usage_metrics
        self.lookup = ProductKeys(dim, n_keys, heads, knn, k_dim, qk_norm, eval_knn)
        n_slots = n_keys**2
        if values is None:
            # registered: this layer owns its table
            self.values = ValuePool(n_slots, v_dim, value_init_scale, value_dtype)
            self.owns_values = True
        else:
            if (values.n_slots, values.v_dim) != (n_slots, v_dim):
                raise ValueError(
                    f"shared value pool is ({values.n_slots}, {values.v_dim}), this layer needs "
                    f"(n_keys**2, v_dim) = ({n_slots}, {v_dim})"
                )
            # A plain attribute, not a submodule: the pool's owner registers it
            # once, so parameters() / state_dict() hold the shared table once.
            self.__dict__["values"] = values
            self.owns_values = False
        self.values.add_reader(heads * knn)
        if not balance_loss_coef >= 0:  # (also NaN)
            raise ValueError(f"balance_loss_coef={balance_loss_coef!r} is invalid: a number >= 0")
        self.balance_loss_coef = balance_loss_coef
        self.sparse_updates = sparse_updates
        check_choice("kernel", kernel, KERNELS)
        resolve_kernel(kernel)  # fail at build time if this machine cannot run it at all
        # Keep the config value: `auto` is resolved per call from the tensors' device.
        self.kernel = kernel
        self.launches = launches  # memory.triton_forward / triton_backward (memory/fast/launches.py)
        self.usage = SlotUsage(n_slots)
        # The auxiliary-loss channel (see memlm.model.Transformer.aux_loss):
        # coefficient * loss of the last training forward, else None.
        self.last_aux_loss: torch.Tensor | None = None

    # The training knn (the knn schedule moves it) and the evaluation knn.
    @property
    def knn(self) -> int:
        return self.lookup.knn

    @knn.setter
    def knn(self, value: int) -> None:
        self.lookup.knn = value  # (checked by the lookup)

    @property
    def eval_knn(self) -> int:
        return self.lookup.eval_knn

    @eval_knn.setter
    def eval_knn(self, value: int) -> None:
        self.lookup.eval_knn = value

    def read(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, dim) -> y (T, v_dim): the weighted bag of H*knn value rows per token."""
        balance = self.training and self.balance_loss_coef > 0
        # Only the balance loss needs the gradient of the full sub-key scores:
        # without it the search's backward touches only the selected sub-keys.
        weights, slots, sub = self.lookup(x, sub="grad" if balance else "none")  # (T, H*knn) x 2, sub or None
        self.last_aux_loss = None
        if self.training:
            self.usage.record(slots)
            if balance:
                self.last_aux_loss = self.balance_loss_coef * balance_loss(sub)
        return self.values.read(slots, weights, sparse=self.sparse_updates, kernel=self.kernel,
                                launches=self.launches)

    def row_tables(self) -> list[nn.Parameter]:
        """The tables whose rows are the slots `usage` counts (finetune=sparse selects among them)."""
        return [self.values.weight]

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialize with the published init, e.g. after `to_empty()`.
        A shared pool is initialized by its owner, not here. Layers are also
        initialized at construction, like torch.nn layers."""
        self.lookup.init_weights()
        if self.owns_values:
            self.values.init_weights()
        self.usage.reset()
        self._init_projections()

    def _init_projections(self) -> None:
        """The variant's own projections (subclasses)."""

    def read_flops_per_token(self) -> int:
        """Lookup + the H*knn value rows read (one multiply-add per entry).
        The table itself is not computed over."""
        return self.lookup.flops_per_token() + 2 * self.lookup.heads * self.knn * self.v_dim


class Memory(ProductKeyMemory):
    """Plain product-key memory (Lample et al. 2019): out = y, or W_o y.

    `output_proj=None` adds W_o (v_dim -> dim, no bias) only when v_dim != dim."""

    def __init__(self, dim: int, *args, output_proj: bool | None = None, **kwargs):
        super().__init__(dim, *args, **kwargs)
        if output_proj is None:
            output_proj = self.v_dim != dim
        if not output_proj and self.v_dim != dim:
            raise ValueError(f"v_dim={self.v_dim} != dim={dim} needs an output projection")
        self.out = nn.Linear(self.v_dim, dim, bias=False) if output_proj else None
        self._init_projections()  # lookup and pool initialized themselves

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., dim) -> (..., dim)
        shape = x.shape
        y = self.read(x.reshape(-1, self.dim)).to(x.dtype)  # (T, v_dim)
        if self.out is not None:
            y = self.out(y)
        return y.reshape(shape)

    @torch.no_grad()
    def _init_projections(self) -> None:
        if self.out is not None:
            nn.init.normal_(self.out.weight, mean=0.0, std=self.dim**-0.5)

    def flops_per_token(self) -> int:
        proj = 2 * self.v_dim * self.dim if self.out is not None else 0
        return self.read_flops_per_token() + proj


class MemoryPlus(ProductKeyMemory):
    """Memory+: out = W2(y * gate(W1 x)), gate in {swilu (silu), sigmoid, none}.

    `bias=True` (memory.w_bias) gives W1 and W2 biases, as the official code's
    projections have: out = W2(y * gate(W1 x + b1)) + b2, both biases starting at 0.
    Without it the layer has no bias tensors (its state dict as before the switch)."""

    def __init__(self, dim: int, *args, gate: str = "swilu", bias: bool = False, **kwargs):
        super().__init__(dim, *args, **kwargs)
        check_choice("gate", gate, GATES)
        self.gate = gate
        self.w1 = nn.Linear(dim, self.v_dim, bias=bias) if gate != "none" else None  # W1: dim -> v_dim
        self.w2 = nn.Linear(self.v_dim, dim, bias=bias)  # W2: v_dim -> dim
        self._init_projections()  # lookup and pool initialized themselves

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., dim) -> (..., dim)
        shape = x.shape
        x = x.reshape(-1, self.dim)  # (T, dim)
        y = self.read(x).to(x.dtype)  # (T, v_dim)
        if self.gate == "swilu":
            y = y * F.silu(self.w1(x))
        elif self.gate == "sigmoid":
            y = y * torch.sigmoid(self.w1(x))
        return self.w2(y).reshape(shape)

    @torch.no_grad()
    def _init_projections(self) -> None:
        std = self.dim**-0.5  # published: W1, W2 ~ N(0, d**-0.5)
        for lin in (self.w1, self.w2):
            if lin is not None:
                nn.init.normal_(lin.weight, mean=0.0, std=std)
                if lin.bias is not None:  # (the official code leaves its biases to the caller: docs/memory.md)
                    nn.init.zeros_(lin.bias)

    def flops_per_token(self) -> int:
        gate = 2 * self.dim * self.v_dim if self.w1 is not None else 0
        return self.read_flops_per_token() + gate + 2 * self.v_dim * self.dim

