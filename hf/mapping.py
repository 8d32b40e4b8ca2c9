"""Hugging Face `LlamaForCausalLM` interoperability for dense models.

memlm's decoder uses the same RoPE layout as `transformers`' Llama ("rotate
half"), so weights map one to one by name; no q/k permutation is needed.
`transformers` is imported lazily: it is only needed to build a HF config;
`from_hf_json` reads a checkpoint's `config.json` without it (the import of
`init_from=hf:<dir>`, memlm.run.importer).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from memlm.model.args import ModelArgs
from memlm.model.family import family_of

# memlm name (per layer, after "layers.{i}.") -> HF name (after "model.layers.{i}.")
_LAYER_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_names(args: ModelArgs) -> dict[str, str]:
    """memlm name -> HF name of every tensor of the dense model `args` describes."""
    return _key_map(args)


def _key_map(args: ModelArgs) -> dict[str, str]:
    mapping = dict(_GLOBAL_KEYS)
    if args.tie_embeddings:
        del mapping["output.weight"]
    for i in range(args.n_layers):
        for ours, theirs in _LAYER_KEYS.items():
            mapping[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return mapping


def _check_dense(args: ModelArgs, memory: Any = None) -> None:
    if not family_of(args.ffn).llama_equivalent or (memory is not None and memory.places_layers()):
        raise ValueError(
            "only dense models (model.ffn=dense, memory.kind=none, no memory.engram.layers) have a Hugging Face Llama "
            "equivalent; export memory models with memlm's own safetensors format"
        )


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """memlm Transformer state dict -> LlamaForCausalLM state dict."""
    _check_dense(args)
    mapping = _key_map(args)
    unknown = sorted(set(state_dict) - set(mapping))
    missing = sorted(set(mapping) - set(state_dict))
    if unknown or missing:
        raise KeyError(f"state dict does not match the dense model: unknown {unknown[:5]}, missing {missing[:5]}")
    out = {mapping[k]: v for k, v in state_dict.items()}
    if args.tie_embeddings:
        # transformers lists the tied head under its own name too.
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM state dict -> memlm Transformer state dict.

    HF keeps `lm_head.weight` in tied models too (as an alias); it is dropped."""
    _check_dense(args)
    inverse = {theirs: ours for ours, theirs in _key_map(args).items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key in inverse:
            out[inverse[key]] = value
        elif key == "lm_head.weight" and args.tie_embeddings:
            continue
        elif key.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from rope_theta
        else:
            raise KeyError(f"unexpected Hugging Face key {key!r} for a Llama with {args.n_layers} layers")
    missing = sorted(set(inverse.values()) - set(out))
    if missing:
        raise KeyError(f"Hugging Face state dict lacks {missing[:5]}")
    return out


def to_hf_config(args: ModelArgs, **extra: Any):
    """A `transformers.LlamaConfig` with the same architecture as `args`."""
    from transformers import LlamaConfig

    _check_dense(args)
    return LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        tie_word_embeddings=args.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        **extra,
    )


def from_hf_config(config: Any) -> ModelArgs:
    """ModelArgs for a `transformers.LlamaConfig` (plain RoPE only)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type != "default":
        raise ValueError(f"RoPE scaling {rope_type!r} is not supported; memlm implements plain RoPE")
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta or getattr(config, "rope_theta", 10000.0)
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported; memlm's SwiGLU uses silu")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError("Llama variants with attention or MLP biases are not supported")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        raise ValueError(f"head_dim={head_dim} x heads != hidden_size; memlm requires dim = heads x head_dim")
    return ModelArgs(
        name="hf",
        dim=config.hidden_size,
        n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        vocab_size=config.vocab_size,
        ffn_hidden_dim=config.intermediate_size,
        norm_eps=config.rms_norm_eps,
        rope_theta=float(theta),
        max_seq_len=config.max_position_embeddings,
        tie_embeddings=bool(config.tie_word_embeddings),
    )


# LlamaConfig's defaults for the keys an older or hand-written config.json may omit.
_LLAMA_DEFAULTS = {
    "num_key_value_heads": None, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
    "rope_parameters": None, "max_position_embeddings": 2048, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "head_dim": None, "hidden_act": "silu",
}
# Keys without a default: a config.json lacking one is not a Llama config.
HF_REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")


def from_hf_json(values: dict[str, Any]) -> ModelArgs:
    """ModelArgs for a Llama `config.json` read as plain JSON (no transformers needed).

    Raises KeyError naming a missing required key, ValueError for an unsupported variant."""
    missing = [k for k in HF_REQUIRED_KEYS if k not in values]
    if missing:
        raise KeyError(f"config.json lacks {missing}")
    return from_hf_config(SimpleNamespace(**{**_LLAMA_DEFAULTS, **values}))
