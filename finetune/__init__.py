"""Fine-tuning: what a run trains, one object per `finetune.mode` (docs/finetuning.md).

    python -m memlm.train finetune=memory init_from=runs/base data=...
    python -m memlm.train finetune=sparse finetune.top_t=2000 init_from=runs/base data=...

    from memlm.finetune import mode_of
    mode_of(cfg).freeze(model)     # and the rest of memlm.finetune.modes.Mode

- `config.py`: the `finetune.*` section of the run config;
- `modes.py`: the modes (full, memory, sparse, lora), each owning what it means
  everywhere: validation, what trains, the step hook, init, export;
- `selection.py`: sparse's per-step row selection;
- `background.py`: slot-usage counts, the background sparse ranks against
  (written by `python -m memlm.train.slot_usage`).
"""

from memlm.finetune.config import FinetuneConfig
from memlm.finetune.modes import MODES, Mode, mode_of

__all__ = ["MODES", "FinetuneConfig", "Mode", "mode_of"]
