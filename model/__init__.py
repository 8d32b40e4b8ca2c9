"""The Llama-style decoder: norms, RoPE, attention, FFN slots, the Transformer.

Importing this package registers every built-in FFN kind.

    from memlm.model import ModelArgs, build_model
    model = build_model(ModelArgs(dim=256, n_layers=4, n_heads=4, vocab_size=1024))

An export loads with `memlm.hf.from_pretrained(export_dir)` (hf/ sits above
this package and imports it).
"""

# moe and peer are imported for their side effect: registering their FFN kinds.
import memlm.model.memory_ffn  # noqa: F401
import memlm.model.moe  # noqa: F401
import memlm.model.peer  # noqa: F401
import memlm.model.ultramem_ffn  # noqa: F401
from memlm.model.args import ModelArgs
from memlm.model.build import build_model
from memlm.model.family import Family, families, family_of, memory_family, register_family
from memlm.model.ffn import FFNContext, build_ffn, ffn_kinds
from memlm.model.kv_cache import KVCache
from memlm.model.transformer import Transformer, layer_ffn_kinds

__all__ = [
    "FFNContext",
    "Family",
    "KVCache",
    "ModelArgs",
    "Transformer",
    "build_ffn",
    "build_model",
    "families",
    "family_of",
    "ffn_kinds",
    "layer_ffn_kinds",
    "memory_family",
    "register_family",
]

