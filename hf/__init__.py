"""memlm.hf: the Hugging Face format: names, export folders, the tokenizer's files, remote code.

- `mapping.py`: memlm <-> HF Llama names and configs.
- `pretrained.py`: an export folder's files and manifest; `from_pretrained(export_dir)`, an export as a
  memlm model.
- `bundle.py`: the tokenizer files of an export (sentencepiece -> HF).
- `remote/`: the modeling code an export ships for `trust_remote_code`.

What reads a run and writes or reads these folders (the export command, `init_from`'s import,
`load_model`) lives in memlm.run; `python -m memlm.hf.export` still runs the export (run/export.py).

Imports: model, memory, errors, files.
"""

from memlm.hf.pretrained import from_pretrained

__all__ = ["from_pretrained"]
