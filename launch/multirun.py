"""`python -m memlm.train -m key=a,b ...`: Hydra's multirun, one point after another.

memlm does not hand the process to Hydra's launcher (its runs would land in
Hydra's outputs/ folders and skip memlm's validation); `-m` is the same local
sweep as `python -m memlm.launch sweep`, on one process per point:

    python -m memlm.train -m memory.n_keys=128,256 optim.lr=1e-3,3e-3 steps=200
"""

from __future__ import annotations

from collections.abc import Sequence

from memlm.errors import entry_point, launcher_rank
from memlm.launch.validate import LaunchError


@entry_point
def multirun(argv: Sequence[str]) -> int:
    """Run every point of the sweep in `argv` (train's arguments, with or
    without -m/--multirun); returns the exit code (0 when every point finished)."""
    from memlm.launch.sweep import sweep

    args = [a for a in argv if a not in ("-m", "--multirun")]
    if launcher_rank()[1] > 1:
        raise LaunchError("-m/--multirun under torchrun would run every point on every rank; use "
                          "`python -m memlm.launch sweep --nproc N ...` for multi-process points")
    flags = [a for a in args if a.startswith("-")]
    if flags:
        raise LaunchError(f"{flags[0]}: -m/--multirun takes only Hydra overrides (key=a,b ...)")
    if not args:
        raise LaunchError("-m/--multirun needs overrides to sweep, e.g. memory.n_keys=128,256")
    return sweep(args, [])
