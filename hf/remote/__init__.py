"""Hugging Face `trust_remote_code` bundle for memlm models with memory, MoE or PEER layers.

Dense models export as a plain Llama (hf/mapping.py). Every other model gets,
beside its memlm-named safetensors, the source files of this folder (REMOTE_FILES:
the config, the decoder in modeling_memlm.py, and one file per family of layers beside it;
torch + transformers only) and a
`config.json` whose `auto_map` points at them:

    write_remote_code(out_dir, cfg.model, memory)   # called by run/export.py
    # then, anywhere (memlm not needed):
    AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True)

The config maps memlm's ModelArgs and MemoryConfig onto the file's config:
every field of both is either written (`*_TO_CONFIG`, `MEMORY_INFERENCE`) or
listed as training-only (`*_TRAINING_ONLY`); tests/integration/test_hf_remote.py fails
when a new field is in neither, so a setting that changes the math cannot be
added to memlm without the remote model learning it. (A training-only name
may precede its field: the lists are checked for coverage, the mapped names
also for existence.)
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

from memlm.memory.config import MemoryConfig
from memlm.memory.engram_hash import head_primes
from memlm.model.args import ModelArgs
from memlm.model.moe import default_expert_hidden_dim
from memlm.model.transformer import layer_ffn_kinds

SOURCE_DIR = Path(__file__).parent
REMOTE_FILES = ("configuration_memlm.py", "modeling_memlm.py", "layers_memlm.py", "experts_memlm.py",
                "ultramem_memlm.py", "engram_memlm.py")
AUTO_MAP = {
    "AutoConfig": "configuration_memlm.MemlmConfig",
    "AutoModelForCausalLM": "modeling_memlm.MemlmForCausalLM",
}

# ModelArgs fields -> what the remote config holds for them.
MODEL_TO_CONFIG = {
    "dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size", "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta", "max_seq_len": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
    # resolved by memlm into intermediate_size / layer_ffn_kinds:
    "ffn_hidden_dim": "intermediate_size", "multiple_of": "intermediate_size",
    "ffn_dim_multiplier": "intermediate_size", "ffn": "layer_ffn_kinds",
}
# doc_mask, rope_restart, doc_mask_backend: packed training rows (memlm.model.doc_mask);
# generation and evaluation run one document per row, where they change nothing.
MODEL_TRAINING_ONLY = ("name", "init_std", "depth_init", "doc_mask", "rope_restart", "doc_mask_backend")
# MemoryConfig fields the remote model reads (resolved: v_dim, expert_hidden_dim),
# or that only decide which blocks hold which kind (-> layer_ffn_kinds).
MEMORY_INFERENCE = (
    "n_keys", "heads", "knn", "eval_knn", "k_dim", "v_dim", "share_values", "qk_norm", "gate",
    "placement", "value_dtype", "n_experts", "top_k", "expert_hidden_dim", "w_bias",
    "rank", "expansion", "candidates", "pre_dim", "ffn_fraction",
)
# Of those, UltraMemV2's (configuration_memlm.ULTRAMEM_KEYS): written only for a model
# with an ultramem block, so every other export's config.json is what it was before them.
ULTRAMEM_KEYS = ("rank", "expansion", "candidates", "pre_dim", "ffn_fraction")
# Of those, the switches config.json carries only when on (configuration_memlm.MEMORY_SWITCHES):
# a model without them exports the config.json it exported before they existed.
MEMORY_SWITCHES = ("w_bias",)
MEMORY_LAYER_CHOICE = ("kind", "layers", "spread")
MEMORY_TRAINING_ONLY = (
    "value_lr", "value_weight_decay", "value_init_scale", "value_grad_clip", "value_grad_reduce_dtype",
    "balance_loss_coef", "sparse_updates", "kernel", "triton_algorithm", "triton_forward", "triton_backward",
    "knn_schedule_start", "knn_schedule_steps",
)
# Sections of MemoryConfig written as their own config.json key (engram_settings).
MEMORY_SECTIONS = ("engram",)
# FFN kinds the modeling file implements (tests check this against memlm's registry).
REMOTE_KINDS = ("dense", "memory", "memplus", "moe", "peer", "ultramem")


def memory_settings(args: ModelArgs, memory: MemoryConfig | None) -> dict[str, Any]:
    """Every MEMORY_INFERENCE setting, resolved (v_dim 0 -> model.dim, expert_hidden_dim
    0 -> the dense size // top_k), plus the remote file's peer_activation."""
    # The builders' own default when there is no memory section (model.ffn=moe, peer, ...).
    mem = memory if memory is not None else MemoryConfig(kind=args.ffn)
    settings = {key: getattr(mem, key) for key in MEMORY_INFERENCE}
    settings["v_dim"] = mem.v_dim or args.dim
    settings["expert_hidden_dim"] = (mem.expert_hidden_dim
                                     or default_expert_hidden_dim(args.hidden_dim, max(mem.top_k, 1)))
    settings["peer_activation"] = "gelu"  # model/peer.py builds PEER with its default activation
    if "ultramem" in layer_ffn_kinds(args, memory):  # the layer's own defaults, resolved (memory/ultramem.py)
        settings["v_dim"] = mem.v_dim or max(1, 3 * args.dim // 16)
        settings["pre_dim"] = mem.pre_dim or max(1, args.dim // 16)
        settings["candidates"] = mem.candidates or min(mem.knn, mem.n_keys)
    else:
        for key in ULTRAMEM_KEYS:
            del settings[key]
    return settings


def engram_settings(args: ModelArgs, memory: MemoryConfig | None) -> dict[str, Any]:
    """config.json's `engram` (engram_memlm.py): the layers and their sizes resolved, each head's prime
    table size by order (memlm.memory.engram_hash.head_primes); {} without Engram layers."""
    e = memory.engram if memory is not None else None
    if e is None or not e.layers:
        return {}
    rows = e.resolved_rows_per_head(args.vocab_size)
    return {"layers": sorted(e.layers), "max_order": e.max_order, "heads": e.heads, "head_dim": e.head_dim,
            "kernel_size": e.kernel_size, "dilation": e.resolved_dilation(), "hash_seed": e.hash_seed,
            "head_rows": head_primes([rows] * (e.max_order - 1), e.heads)}


def remote_config(args: ModelArgs, memory: MemoryConfig | None) -> dict[str, Any]:
    """The config.json of a remote-code bundle (a plain dict, no transformers needed)."""
    kinds = layer_ffn_kinds(args, memory)
    unknown = sorted(set(kinds) - set(REMOTE_KINDS))
    if unknown:
        raise ValueError(f"FFN kinds {unknown} have no Hugging Face modeling code; known: {list(REMOTE_KINDS)}")
    settings = memory_settings(args, memory)
    for key in MEMORY_SWITCHES:  # written only when on
        if not settings[key]:
            del settings[key]
    engram = engram_settings(args, memory)
    return {
        "architectures": ["MemlmForCausalLM"],
        "model_type": "memlm",
        "auto_map": dict(AUTO_MAP),
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "tie_word_embeddings": args.tie_embeddings,
        "layer_ffn_kinds": kinds,
        "memory": settings,
        **({"engram": engram} if engram else {}),  # only with Engram layers: other exports' config.json as before
        "torch_dtype": "float32",
        "use_cache": True,
    }


def write_remote_code(
    out_dir: str | Path, args: ModelArgs, memory: MemoryConfig | None, extra: dict[str, Any] | None = None
) -> Path:
    """Write config.json (with auto_map) and the two modeling files into `out_dir`.
    `extra`: more config.json keys, e.g. bos/eos/pad token ids."""
    out_dir = Path(out_dir)
    config = {**remote_config(args, memory), **(extra or {})}
    for name in REMOTE_FILES:
        shutil.copyfile(SOURCE_DIR / name, out_dir / name)
    path = out_dir / "config.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def config_fields() -> tuple[set[str], set[str]]:
    """(ModelArgs fields, MemoryConfig fields): what the mapping above must cover."""
    return ({f.name for f in dataclasses.fields(ModelArgs)}, {f.name for f in dataclasses.fields(MemoryConfig)})


__all__ = ["AUTO_MAP", "REMOTE_FILES", "REMOTE_KINDS", "config_fields", "engram_settings", "memory_settings",
           "remote_config", "write_remote_code"]
