"""`python -m memlm.train.plan` still runs the scale planner, now `python -m memlm.plan` (memlm/plan/)."""

if __name__ == "__main__":
    from memlm.plan.cli import main

    raise SystemExit(main())
