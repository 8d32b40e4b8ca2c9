"""Product-key memory layers, usable on their own inside any PyTorch model.

    from memlm.memory import MemoryPlus
    mem = MemoryPlus(dim=512, n_keys=256, heads=4, knn=32, k_dim=512)

See docs/memory.md for the math, the config keys and the training hooks
(knn schedule, usage metrics, auxiliary loss, sparse value updates).
memory/reference.py states the math plainly (the tests' oracle); the fast
paths the layers run (custom ops, kernels, the search's autograd) live in
memory/fast/, which imports nothing from this folder.
"""

from memlm.memory.config import MemoryConfig
from memlm.memory.fast.ops import embedding_bag
from memlm.memory.fast.search import product_key_topk, subkey_scores
from memlm.memory.fast.search_grad import product_key_search
from memlm.memory.layers import Memory, MemoryPlus, ProductKeyMemory
from memlm.memory.product_keys import ProductKeys, balance_loss
from memlm.memory.schedule import apply_knn_schedule, knn_at_step, set_knn
from memlm.memory.sparse_adamw import SparseRowAdamW, clip_grad_norm_
from memlm.memory.tables import sparse_tables, split_params, value_parameters
from memlm.memory.usage import SlotUsage, reset_usage, usage_metrics
from memlm.memory.values import ValuePool

__all__ = [
    "Memory",
    "MemoryConfig",
    "MemoryPlus",
    "ProductKeyMemory",
    "ProductKeys",
    "SlotUsage",
    "SparseRowAdamW",
    "ValuePool",
    "apply_knn_schedule",
    "balance_loss",
    "clip_grad_norm_",
    "embedding_bag",
    "knn_at_step",
    "product_key_search",
    "product_key_topk",
    "reset_usage",
    "set_knn",
    "sparse_tables",
    "split_params",
    "subkey_scores",
    "usage_metrics",
    "value_parameters",
]
