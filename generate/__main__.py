"""`python -m memlm.generate <checkpoint|export> --prompt ...` (see memlm.generate.cli)."""

import sys

from memlm.generate.cli import main

sys.exit(main())
