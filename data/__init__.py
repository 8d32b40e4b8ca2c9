"""memlm.data: corpus -> tokenizer -> token shards -> the resumable training loader.

The trainer needs one function: `memlm.data.loader.build_loader(cfg.data, rank, world_size)`
(its module docstring holds the contract). Commands: `python -m memlm.data.tokenizer`,
`python -m memlm.data.prepare`, `python -m memlm.data.synthetic`, `python -m memlm.data.facts`,
`python -m memlm.data.continual` (a continual-learning study's corpora). See docs/data.md.
"""
