"""Training: configs, the trainer, checkpoints, export.

Public entry points for other packages: `memlm.train.config.compose`,
`memlm.train.load.load_model`, `memlm.train.trainer.Trainer`.
"""
