"""`python -m memlm.train <hydra overrides>`: train a model (see memlm.train.trainer)."""

import sys

from memlm.train.cli import main

sys.exit(main())
