"""memlm.generation: decoding a model's continuations, for the harness and for `python -m memlm.generate`.

    from memlm.generation.text import generate
    done = generate(model, tokenizer, ["Q: Where was Ada Lovelace born?\\nA:"], stop=["\\n"])

- `decoding.py`: batched decoding with the KV cache, prompts grouped by
  length; greedy, or any token choice (`pick`).
- `sampling.py`: temperature, top-k, top-p and per-prompt seeds.
- `text.py`: `generate()` on text prompts, one `Completion` each.

Imports nothing of memlm but `errors`: the model and tokenizer come from the
caller (memlm.generate.load reads them from a path; the harness gets them
from the trainer or memlm.evals.cli), and a sharded model's ranks are matched
by the lock the harness passes (memlm.evals.lockstep).
"""
