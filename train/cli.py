"""Command line of `python -m memlm.train`.

    python -m memlm.train [hydra overrides ...]
    torchrun --nproc_per_node 2 -m memlm.train [hydra overrides ...]
"""

from __future__ import annotations

import sys

from memlm.errors import ConfigError
from memlm.train.config import GROUPS, compose, group_options

USAGE = """usage: python -m memlm.train [key=value ...]

Train a memlm model. Arguments are Hydra overrides of configs/:
  model=373m memory=memplus data=synthetic steps=1000 optim.lr=1e-3 name=myrun
Under torchrun every rank runs the same command.
Start from a Hugging Face Llama: init_from=hf:<dir> (docs/checkpoints.md).

Config groups and their presets:
{groups}
Print the composed config without training: python -m memlm.train --cfg [overrides]
Sweep (Hydra multirun), one run after another: python -m memlm.train -m memory.n_keys=64,128 [overrides]
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        groups = "\n".join(f"  {g:<11} {', '.join(group_options(g))}" for g in GROUPS)
        print(USAGE.format(groups=groups))
        return 0
    if any(a in ("-m", "--multirun") for a in argv):
        from memlm.launch.multirun import multirun

        return multirun(argv)  # one run per sweep point, one after another
    show_only = "--cfg" in argv
    overrides = [a for a in argv if a != "--cfg"]
    try:
        cfg = compose(overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if show_only:
        from memlm.train.config import to_yaml

        print(to_yaml(cfg))
        return 0
    from memlm.train.checkpoint import CheckpointError
    from memlm.train.distributed import shutdown
    from memlm.train.run_lock import RunLockedError
    from memlm.train.trainer import Trainer

    try:
        Trainer(cfg).fit()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (RunLockedError, CheckpointError) as err:  # a busy dump_dir, a bad checkpoint: one clear line
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        shutdown()
    return 0
