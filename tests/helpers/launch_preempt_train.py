"""Stand-ins for the trainer in the preemption tests.

Run as a module it replaces `python -m memlm.train` in the Slurm preemption
test: it takes the same overrides, joins the process group, installs
memlm.train.preemption's handler and "trains" (one all-reduce per step)
until check() says stop; the callback writes `<dump_dir>/preempted_at_step`.
The batch script, torchrun's forwarding and the handler are the real ones;
only the training work (and srun) is stubbed. `stop_together` is the rank
function of the two-rank agreement test.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from memlm.config.run import compose
from memlm.distributed.env import ProcessGroup
from memlm.train.preemption import install_preemption_handler


def main(argv: list[str]) -> int:
    cfg = compose(argv)
    with ProcessGroup("cpu") as env:
        dump_dir = Path(cfg.dump_dir)
        step = 0
        handler = install_preemption_handler(lambda: (dump_dir / "preempted_at_step").write_text(str(step)))
        if env.is_main:
            (dump_dir / "ready").write_text(" ".join(argv))
        deadline = time.monotonic() + 120  # a stuck test ends instead of hanging forever
        while not handler.check() and time.monotonic() < deadline:
            step += 1
            time.sleep(0.05)
        handler.uninstall()
    return 0 if handler.stopped else 3


def stop_together(rank: int, out_dir: str, signal_rank: int, signal_step: int) -> None:
    """Rank `signal_rank` signals itself at step `signal_step`; every rank records where it stopped."""
    import json
    import signal

    calls = []
    handler = install_preemption_handler(lambda: calls.append(True))
    step = 0
    try:
        for step in range(1, 50):
            if rank == signal_rank and step == signal_step:
                signal.raise_signal(signal.SIGUSR1)
            if handler.check():
                break
        handler.check()  # later calls neither communicate nor run the callback again
    finally:
        handler.uninstall()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"step": step, "callbacks": len(calls),
                                                              "requested": handler.requested}))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
