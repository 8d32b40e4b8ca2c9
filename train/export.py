"""`python -m memlm.train.export` still exports a checkpoint, now `python -m memlm.hf.export` (memlm/hf/)."""

if __name__ == "__main__":
    from memlm.run.export import main

    raise SystemExit(main())
