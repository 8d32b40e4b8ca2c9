"""memlm.distributed: how a model runs on many ranks. The model code itself has
no distributed code; everything that shards, gathers or reduces is here.

- `env.py`: the process group (`cpu:gloo,cuda:nccl`), `DistEnv`, the device
  meshes (FSDP, memory-parallel groups), seeding, dying with torchrun.
- `parallelize.py`: activation checkpointing, torch.compile, FSDP2 units.
- `precision.py`: the compute dtype, autocast and TF32 rules.
- `memory_hooks.py`: what the trainer does for memory layers (value-table
  layout and sharding, `memory_parallel=auto`, knn schedule, usage metrics).
- `memory_parallel.py`: a value table sharded by columns over a group of
  ranks, and its read (all-gather, local bag, all-to-all).
- `value_layout.py`: what each memory_parallel costs in bytes and seconds.
- `value_grads.py`: summing value-table gradients over replicas (dense or touched rows).
- `clip.py`: gradient-norm clipping of sharded and sparse gradients.

Imports: config, model, memory, errors.
"""
