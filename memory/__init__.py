"""Product-key memory layers, usable on their own inside any PyTorch model."""

from memlm.memory.config import MemoryConfig

__all__ = ["MemoryConfig"]
