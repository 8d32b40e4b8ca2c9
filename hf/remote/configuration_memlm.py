"""Configuration of memlm models in Hugging Face transformers (trust_remote_code).

This file is copied verbatim into every non-dense export (next to
modeling_memlm.py) and must import nothing but transformers: the bundle
loads where memlm is not installed.

    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(export_dir, trust_remote_code=True)

Decoder sizes use the usual Hugging Face names; what is memlm's own:
- `layer_ffn_kinds`: the FFN kind of every block ("dense", "memory",
  "memplus", "moe", "peer", "ultramem"), resolved by memlm at export time;
- `memory`: the settings those layers need at inference, resolved (v_dim and
  expert_hidden_dim are numbers, never 0). Training-only settings (learning
  rates, kernels, losses) are not part of it.
- `engram`: the Engram layers' settings, resolved (written only for a model
  that has them).
"""

from transformers import PretrainedConfig

FFN_KINDS = ("dense", "memory", "memplus", "moe", "peer", "ultramem")
# The keys of `memory` this file's model reads (the export writes exactly these).
MEMORY_KEYS = (
    "n_keys", "heads", "knn", "eval_knn", "k_dim", "v_dim", "share_values", "qk_norm", "gate",
    "placement", "value_dtype", "n_experts", "top_k", "expert_hidden_dim", "peer_activation",
)
# Switches the export writes only when on (absent: off, as in exports made before them).
MEMORY_SWITCHES = ("w_bias",)
# UltraMemV2's settings (resolved), written only for a model with an ultramem block.
ULTRAMEM_KEYS = ("rank", "expansion", "candidates", "pre_dim", "ffn_fraction")


class MemlmConfig(PretrainedConfig):
    model_type = "memlm"

    def __init__(
        self,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=None,
        head_dim=None,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        layer_ffn_kinds=None,
        memory=None,
        engram=None,
        tie_word_embeddings=False,
        use_cache=True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.layer_ffn_kinds = list(layer_ffn_kinds or ["dense"] * num_hidden_layers)
        self.memory = dict(memory or {})
        # Engram layers (engram_memlm.py): layers, max_order, heads, head_dim, kernel_size, dilation,
        # hash_seed and head_rows (each head's prime table size, by order); {} for none.
        self.engram = dict(engram or {})
        self.use_cache = use_cache
        if len(self.layer_ffn_kinds) != num_hidden_layers:
            raise ValueError(
                f"layer_ffn_kinds has {len(self.layer_ffn_kinds)} entries, num_hidden_layers is {num_hidden_layers}"
            )
        unknown = sorted(set(self.layer_ffn_kinds) - set(FFN_KINDS))
        if unknown:
            raise ValueError(f"layer_ffn_kinds holds {unknown}: this modeling file knows {list(FFN_KINDS)}")
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
