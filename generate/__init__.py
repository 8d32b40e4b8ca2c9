"""Text generation: `python -m memlm.generate <checkpoint|export> --prompt ...`
and the Python call (docs/generation.md).

    from memlm.generate import generate, load

    model, tokenizer = load("runs/demo")
    print(generate(model, tokenizer, "Q: Where was Ada Lovelace born?\\nA:", stop=["\\n"])[0].text)

`load` is here, on the top floor, because it reads a model path (checkpoint,
run folder or export: memlm.run.load); generating from a model in memory is
memlm.generation.text, below the harness that decodes the same way. The
command line is `cli.py`.
"""

from __future__ import annotations

from pathlib import Path

from memlm.errors import ConfigError
from memlm.generation.text import Completion, generate

__all__ = ["Completion", "generate", "load"]


def load(path: str | Path, device: str = "cpu", tokenizer: str | Path | None = None):
    """(model in eval mode, Tokenizer) from a checkpoint folder, a `latest`
    file, a run's dump_dir or an export folder; `tokenizer` overrides the
    sentencepiece model the checkpoint names."""
    from memlm.checkpoint.folder import missing_checkpoint
    from memlm.data.tokenizer import Tokenizer
    from memlm.run.load import load_model

    if not Path(path).exists():  # a missing input: exit 1 from every command
        raise missing_checkpoint(path)
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise ConfigError("tokenizer", str(tokenizer), "an existing sentencepiece .model file")
    loaded = load_model(path, device)
    tokenizer_path = tokenizer or loaded.tokenizer_path
    if not tokenizer_path:
        raise ConfigError("tokenizer", "", f"the sentencepiece .model the model was trained with "
                                           f"({loaded.source} names none)")
    return loaded.model, Tokenizer(str(tokenizer_path))
