"""`python -m memlm.train <hydra overrides>`: train a model (see memlm.train.trainer).

With -m/--multirun (a Hydra sweep) each point runs in turn through the
launcher (memlm.launch.multirun), which sits above train: this entry point
is the one place that knows both.
"""

import sys

from memlm.launch.multirun import multirun
from memlm.train.cli import main

argv = sys.argv[1:]
sys.exit(multirun(argv) if any(a in ("-m", "--multirun") for a in argv) else main(argv))
