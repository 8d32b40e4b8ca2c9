"""memlm.run: a model path and the run behind it.

- `source.py`: what a model path names (a checkpoint, a run's dump_dir, `checkpoints/latest`, an
  export, `hf:<Llama dir>`).
- `model.py`: `build_run_model(cfg, ...)`, the model a run holds, built in one place for training,
  loading, exporting and slot usage.
- `load.py`: `load_model(path)`: a memlm checkpoint or an export, with its tokenizer and data config
  (the evals, generation and lm-eval use it); the run folder's readers.
- `export.py`: a checkpoint -> an export folder (`python -m memlm.hf.export`).
- `importer.py`: `init_from=<export>` and `init_from=hf:<Llama dir>`.

Imports: hf, checkpoint, distributed, config, finetune, model, memory, data.
"""
