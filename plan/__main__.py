"""`python -m memlm.plan`: the scale planner (memlm/plan/planner.py)."""

from memlm.plan.cli import main

raise SystemExit(main())
