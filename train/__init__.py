"""Training: configs, the trainer, checkpoints, export.

Public entry points for other packages: `memlm.config.run.compose`,
`memlm.run.load.load_model`, `memlm.train.trainer.Trainer`.
"""
