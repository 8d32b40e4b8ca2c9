"""`python -m memlm.hf.export <checkpoint> <out_dir>`: the export command, which lives in memlm.run.export
(it reads a run's checkpoint and config; docs/checkpoints.md)."""

if __name__ == "__main__":
    from memlm.run.export import main

    raise SystemExit(main())
