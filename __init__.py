"""memlm: pretraining language models with product-key memory layers."""

__version__ = "0.1.0"
