"""The Llama-style decoder with configurable feed-forward slots.

Build on the meta device, move to a real device, then initialize:

    with torch.device("meta"):
        model = Transformer(args, memory_cfg)
    model.to_empty(device="cpu")
    model.init_weights()
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memlm.memory.tables import sparse_tables
from memlm.model.args import ModelArgs
from memlm.model.block import Block
from memlm.model.doc_mask import doc_attention_mask, doc_positions
from memlm.model.engram_slot import build_engram
from memlm.model.ffn import FFNContext, build_ffn
from memlm.model.kv_cache import KVCache
from memlm.model.norms import RMSNorm
from memlm.model.rope import rope_cos_sin


def layer_ffn_kinds(args: ModelArgs, memory: Any = None) -> list[str]:
    """The FFN kind of each block: `memory.kind` in the memory blocks, `args.ffn` elsewhere."""
    special = set(memory.resolved_layers(args.n_layers)) if memory is not None else set()
    return [memory.kind if i in special else args.ffn for i in range(args.n_layers)]


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, memory: Any = None, token_map: torch.Tensor | None = None):
        """`token_map` (vocab_size,): the Engram layers' canonical ids (memory.engram; None: the identity).
        It is a buffer of their state: a checkpoint's map replaces it when loaded."""
        super().__init__()
        self.args = args
        self.memory_config = memory
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        shared: dict[str, Any] = {}
        self.layers = nn.ModuleList()
        for layer_id, kind in enumerate(layer_ffn_kinds(args, memory)):
            ffn = build_ffn(kind, FFNContext(args, layer_id, memory, shared))
            engram = build_engram(args, memory, layer_id, token_map)
            self.layers.append(Block(args, layer_id, ffn, kind, engram))
        # Objects several blocks share (a memory value pool) live here once, so
        # state_dict() and parameters() hold them exactly once.
        self.shared = nn.ModuleDict({k: v for k, v in shared.items() if isinstance(v, nn.Module)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_cos_sin(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    # ----------------------------------------------------------------- init
    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialize every weight in place (after `to_empty` when built on meta)."""
        device = self.tok_embeddings.weight.device
        cos, sin = rope_cos_sin(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device)
        # Buffers are not kept by to_empty(): recompute them on the weights' device.
        self.rope_cos, self.rope_sin = cos, sin
        std = self.args.init_std
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        for block in self.layers:
            block.init_weights()
        for module in self.shared.values():
            module.init_weights()
        self.norm.init_weights()
        if self.output is not None:
            out_std = self.args.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, mean=0.0, std=out_std, a=-3 * out_std, b=3 * out_std)

    # -------------------------------------------------------------- forward
    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, *, at: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None,
                engram_rows: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """tokens: (batch, seq) int64 -> logits (batch, seq, vocab).

        With a cache, `tokens` are the next positions after `cache.pos`; the
        cache is filled and advanced. `at` (batch, seq) bool selects positions:
        the logits are then (n selected, vocab), row-major, and the output head
        runs only there (scoring reads a few positions per row; the head over
        every position would be most of its work and memory). `doc_ids` (batch, seq),
        non-decreasing along each row, number the documents of packed rows:
        attention then stays inside each document, and with `args.rope_restart`
        positions restart at each document (memlm.model.doc_mask). `engram_rows`: the Engram
        layers' rows, `engram_rows(tokens)` computed ahead (no cache: with one, the rows of new
        positions reach back into the cache's history); by default computed here."""
        start = cache.pos if cache is not None else 0
        seq = tokens.shape[1]
        if start + seq > self.args.max_seq_len:
            raise ValueError(
                f"sequence of {start + seq} positions exceeds model.max_seq_len={self.args.max_seq_len}"
            )
        cos, sin = self.rope_cos[start:start + seq], self.rope_sin[start:start + seq]
        mask = None
        if doc_ids is not None:
            if cache is not None or doc_ids.shape != tokens.shape:
                raise ValueError(f"doc_ids of shape {tuple(doc_ids.shape)} (cache: {cache is not None}): "
                                 f"valid is the tokens' shape {tuple(tokens.shape)} and no KV cache")
            mask = doc_attention_mask(doc_ids, self.args.doc_mask_backend)
            if self.args.rope_restart:
                pos = doc_positions(doc_ids)  # (batch, seq)
                cos, sin = self.rope_cos[pos].unsqueeze(1), self.rope_sin[pos].unsqueeze(1)
        if cache is not None and engram_rows is not None:
            raise ValueError("engram_rows= with a KV cache is invalid: with a cache each Engram layer "
                             "hashes the new tokens against its history; pass engram_rows= only without one")
        if cache is None and engram_rows is None:
            engram_rows = self.engram_rows(tokens)  # once per forward, before the first block
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            engram_in = None
            if block.engram is not None:
                engram_in = {"rows": engram_rows[block.layer_id]} if cache is None else \
                    {"tokens": tokens, "state": cache.layer_states[block.layer_id], "start": start}
            h = block(h, cos, sin, cache, mask, engram_in)
        if cache is not None:
            cache.advance(seq)
        h = self.norm(h)  # (batch, seq, dim)
        if at is not None:
            h = h[at]  # (n selected, dim)
        return h @ self.output_weight().t()

    def engram_rows(self, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
        """tokens (batch, seq) -> {block index: its Engram layer's rows (batch, seq, H)}: a function of the
        tokens alone, so a caller may compute them ahead of the step and pass them as `engram_rows=`."""
        return {b.layer_id: b.engram.hash(tokens) for b in self.layers if b.engram is not None}

    def output_weight(self) -> torch.Tensor:
        """(vocab, dim): the output head, or the input embedding when tied."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def aux_loss(self) -> torch.Tensor | None:
        """Sum of the auxiliary losses of the last forward pass (memory slot
        balance, MoE load balance), or None when no module produced one.

        The channel: a module that has an auxiliary loss stores it, already
        multiplied by its coefficient, in `self.last_aux_loss` during forward;
        the trainer adds `model.aux_loss()` to the language-model loss."""
        losses = [m.last_aux_loss for m in self.modules() if getattr(m, "last_aux_loss", None) is not None]
        return torch.stack([loss.float() for loss in losses]).sum() if losses else None

    def new_cache(self, batch: int, max_len: int | None = None, device=None, dtype=None) -> KVCache:
        """A cache on the model's device, in `dtype` or else the dtype of the first keys written."""
        max_len = max_len or self.args.max_seq_len
        device = device or self.tok_embeddings.weight.device
        states = {b.layer_id: b.engram.new_state(batch, max_len, device) for b in self.layers if b.engram is not None}
        return KVCache(self.args.n_layers, batch, self.args.kv_heads, self.args.head_dim, max_len, device, dtype,
                       layer_states=states)

    # ----------------------------------------------------------- accounting
    def num_params(self) -> dict[str, int]:
        """Parameter counts split into embedding (input + untied output), memory
        (the sparse tables, memlm.memory.tables: value pools, PEER's expert
        tables) and dense (everything else). Shared tensors count once."""
        tables = {id(p) for p in sparse_tables(self)}
        embedding = {id(p) for m in (self.tok_embeddings, self.output) if m is not None for p in m.parameters()}
        counts = {"dense": 0, "embedding": 0, "memory": 0}
        seen: set[int] = set()
        for p in self.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            category = "memory" if id(p) in tables else "embedding" if id(p) in embedding else "dense"
            counts[category] += p.numel()
        counts["total"] = counts["dense"] + counts["embedding"] + counts["memory"]
        # Active: what one token uses. Sparse modules (memory tables, MoE experts)
        # report the parameters a token does not touch via `inactive_params()`.
        inactive = sum(m.inactive_params() for m in self.modules() if hasattr(m, "inactive_params"))
        counts["active"] = counts["total"] - inactive
        return counts

    def flops_per_token(self, seq_len: int) -> int:
        """Forward FLOPs per token at context `seq_len`, counting only what is
        computed: attention (projections + causal scores), each FFN slot's own
        count (a memory layer counts the rows it reads, not the table), and the
        output head. Norms, RoPE and softmax are ignored (< 1%). A training
        step costs about 3x this."""
        total = 2 * self.args.dim * self.args.vocab_size
        for block in self.layers:
            total += block.attention.flops_per_token(seq_len)
            total += block.feed_forward.flops_per_token()
            if block.engram is not None:
                total += block.engram.flops_per_token()
        return total
