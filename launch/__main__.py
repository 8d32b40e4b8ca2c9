"""`python -m memlm.launch {local,slurm,sweep} ...` (see memlm.launch.cli)."""

import sys

from memlm.launch.cli import main

sys.exit(main())
