"""memlm.checkpoint: saving and restoring a run's state, and its run folder.

- `checkpointer.py`: `Checkpointer` (DCP saves, sync or async, published
  atomically; restore, resharding on a different world size) and `verify`.
- `folder.py`: the checkpoint folders of a run (`step_N`, `latest`, the
  sealed `meta.json` with per-file checksums, each rank hashing its share).
- `run_lock.py`: one run per dump_dir.
- `finite.py`: refusing to save or load non-finite weights.

Imports: config, files, ranks, errors (and torch.distributed.checkpoint). Loading a
model for use (a checkpoint or an export) is memlm.run.load.
"""
