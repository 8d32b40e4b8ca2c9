"""`python -m memlm.train.export` still exports a checkpoint, as `python -m memlm.hf.export` does (run/export.py)."""

if __name__ == "__main__":
    from memlm.run.export import main

    raise SystemExit(main())
