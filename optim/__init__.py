"""memlm.optim: a run's optimizer and learning-rate schedule, built in one place.

- `build.py`: the parameter groups (decay, no decay, the value tables' own group with
  memory.value_lr, value_weight_decay and value_grad_clip), the optimizer that steps them
  (AdamW, the row-wise AdamW or SGD of memlm.memory), the schedule.

The trainer and the planner build it from here. Imports: config, finetune, model, memory.
"""
