"""memlm.hf: everything Hugging Face, and opening a saved model of any kind.

- `export.py`: a checkpoint -> an export folder (`python -m memlm.hf.export`).
- `bundle.py`: the tokenizer files of an export (sentencepiece -> HF).
- `mapping.py`: memlm <-> HF Llama names and configs.
- `pretrained.py`: `from_pretrained(export_dir)`, an export as a memlm model.
- `importer.py`: `init_from=<export>` and `init_from=hf:<Llama dir>`.
- `remote/`: the modeling code an export ships for `trust_remote_code`.
- `load.py`: `load_model(path)`: a memlm checkpoint or an export, with its
  tokenizer and data config (the evals, generation and lm-eval use it).

Imports: checkpoint, config, model, memory, data.
"""

from memlm.hf.pretrained import from_pretrained

__all__ = ["from_pretrained"]
