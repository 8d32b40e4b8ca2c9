"""memlm.plan: tools that describe and plan a run without running it.

    python -m memlm.plan model=8b memory=memplus memory.n_keys=1024 --world 64   # memory, traffic, step time
    python -m memlm.plan.describe model=tiny memory=memplus                      # parameters and FLOPs

- `planner.py`: builds the real model and parallel layout on the meta device
  with a fake process group and reads the bytes of the sharded tensors.
- `report.py`: one plan as text; `fit.py`: --fit and --paper (every layout,
  the ones that fit ranked); `cli.py`: `python -m memlm.plan`.
- `cost.py`: the cost model (activations, communication, step time, MFU).
- `describe.py`: a config's parameter counts and FLOPs per token.

Imports: train (the trainer's optimizer and accumulation), distributed,
config, model, memory. `python -m memlm.train.plan` still runs the planner.
"""
