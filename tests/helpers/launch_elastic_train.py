"""`python -m memlm.train` with one injected failure, for the elastic-restart test.

With MEMLM_TEST_CRASH_AT_STEP=k, rank 1 dies (os._exit(1), like a lost GPU or
node) right after optimizer step k, but only on torchrun's first attempt
(TORCHELASTIC_RESTART_COUNT == 0), so the restarted group can finish. Run as
`torchrun ... -m launch_elastic_train <overrides>` with tests/helpers on PYTHONPATH.
"""

from __future__ import annotations

import os
import sys

from memlm.train.cli import main
from memlm.train.trainer import Trainer


def _install_crash(step: int) -> None:
    original = Trainer.train_step

    def train_step(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.step == step and self.env.rank == 1:
            print(f"[test] rank 1 exits at step {step} (first attempt)", flush=True)
            os._exit(1)
        return out

    Trainer.train_step = train_step


if __name__ == "__main__":
    crash_at = int(os.environ.get("MEMLM_TEST_CRASH_AT_STEP", "0"))
    if crash_at and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        _install_crash(crash_at)
    sys.exit(main(sys.argv[1:]))
