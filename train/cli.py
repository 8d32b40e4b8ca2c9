"""Command line of `python -m memlm.train`.

    python -m memlm.train [hydra overrides ...]
    python -m memlm.train --cfg job|hydra|all [hydra overrides ...]   (memlm.train.show_config)
    torchrun --nproc_per_node 2 -m memlm.train [hydra overrides ...]
"""

from __future__ import annotations

import sys

from memlm.config.run import GROUPS, compose, group_options
from memlm.errors import entry_point
from memlm.train.show_config import render, split_cfg_flag

USAGE = """usage: python -m memlm.train [key=value ...]

Train a memlm model. Arguments are Hydra overrides of configs/:
  model=373m memory=memplus data=synthetic steps=1000 optim.lr=1e-3 name=myrun
Under torchrun every rank runs the same command.
Start from weights: init_from=<checkpoint dir> | <memlm export dir> | hf:<Hugging Face Llama dir>
(docs/checkpoints.md). A dump_dir that has checkpoints is resumed (resume=auto, the default);
resume=none starts it over.

Config groups and their presets:
{groups}
Print the config without training (Hydra's flag, as Hydra users type it):
  python -m memlm.train --cfg job [overrides]    the composed, validated, resolved config (bare --cfg: the same)
  python -m memlm.train --cfg hydra [overrides]  what Hydra records of the composition: the preset of each
                                                 group, the overrides, the config search path
  python -m memlm.train --cfg all [overrides]    both (-c job|hydra|all and --cfg=job work too)
  memlm composes with Hydra's compose API, not @hydra.main: Hydra's output folders, logging and
  launcher are not used (a run writes into its dump_dir), so --cfg hydra shows only the composition.
Sweep (Hydra multirun), one run after another: python -m memlm.train -m memory.n_keys=64,128 [overrides]
"""


@entry_point
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        groups = "\n".join(f"  {g:<11} {', '.join(group_options(g))}" for g in GROUPS)
        print(USAGE.format(groups=groups))
        return 0
    show, overrides = split_cfg_flag(argv)
    if show is not None:
        print(render(show, overrides))
        return 0
    cfg = compose(overrides)
    from memlm.distributed.env import ProcessGroup
    from memlm.train.trainer import Trainer

    # A bad value, data record, checkpoint or eval file, a busy dump_dir, a loss that stayed
    # non-finite: a MemlmError, one line (entry_point); the group ends as ProcessGroup says.
    with ProcessGroup(cfg.device, timeout_s=cfg.parallel.timeout_s):  # a lost peer: PeerLostError, one line
        Trainer(cfg).fit()
    return 0
