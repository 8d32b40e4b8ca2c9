"""`python -m memlm.evals checkpoint=<path> tasks=[...] [key=value ...]` (see memlm.evals.cli)."""

import sys

from memlm.evals.cli import main

sys.exit(main())
