"""memlm.launch: turn a config (or a sweep of configs) into processes.

    python -m memlm.launch local --nproc N [--max-restarts K] -- <overrides>
    python -m memlm.launch slurm --nodes 4 --gpus-per-node 8 [--dry-run] -- <overrides>
    python -m memlm.launch sweep 'key=a,b' ... [--nproc N | --slurm ...] -- <overrides>
    python -m memlm.launch.continual_study     # the learning-vs-forgetting study, run by run

`multirun(argv)` (memlm.launch.multirun) runs `python -m memlm.train -m ...`;
`install_preemption_handler` (memlm.train.preemption) is the trainer's side of
Slurm preemption. This package imports no model code: configs are composed and
described through memlm.train's public functions. See docs/launch.md.
"""
