"""Text generation: `python -m memlm.generate <checkpoint|export> --prompt ...`
and the Python call (docs/generation.md; the code lives in memlm.evals.generation).

    from memlm.generate import generate, load

    model, tokenizer = load("runs/demo")
    print(generate(model, tokenizer, "Q: Where was Ada Lovelace born?\\nA:", stop=["\\n"])[0].text)
"""

from memlm.evals.generation import Completion, generate, load

__all__ = ["Completion", "generate", "load"]

if __name__ == "__main__":
    import sys

    from memlm.evals.generation_cli import main

    sys.exit(main())
