"""memlm decoders in Hugging Face transformers (trust_remote_code), every FFN kind.

This file is copied verbatim into every non-dense memlm export (with
configuration_memlm.py and a config.json whose `auto_map` names both), so

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True)
    out = model.generate(input_ids, max_new_tokens=20)

loads and runs a Memory, Memory+, MoE, PEER or UltraMemV2 model, with or without
Engram layers, where memlm is not installed: it imports torch and transformers only.
This file holds the decoder and the product-key memories; the other families are
files beside it (experts_memlm.py: MoE and PEER; ultramem_memlm.py; engram_memlm.py),
and the table reads they share are layers_memlm.py. Module and parameter
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
(`memlm_engram`), which beam search reorders with the cache's rows (`_reorder_cache`)
and each call cuts to the cache's length (assisted decoding crops the cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_memlm import MEMORY_KEYS, ULTRAMEM_KEYS, MemlmConfig
from .engram_memlm import Engram
from .experts_memlm import PEER, MoE
from .layers_memlm import VALUE_DTYPES, SwiGLU, ValuePool, full_precision, product_key_topk
from .ultramem_memlm import UltraMemFFN

# transformers renamed the cache field of model outputs (past_key_values -> cache).
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
# Where an Engram layer's decoding history rides on transformers' cache object: {layer: {"canon", "conv_in"}}.
ENGRAM_HISTORY = "memlm_engram"
# The FFN kinds that read value tables (memlm.memory.config.PRODUCT_KEY_KINDS): a
# copy, because this file must run where memlm is not installed.
PRODUCT_KEY_KINDS = ("memory", "memplus")


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


# ---------------------------------------------------- product-key memories
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
        with full_precision(x.device):
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
            for history in (histories or {}).values():
                # The attention cache's length is the truth: a cache cropped since the last call (assisted
                # decoding drops the candidates it rejected, Cache.crop) drops them from the history too.
                for key, past in history.items():
                    history[key] = past[:, :start]
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
