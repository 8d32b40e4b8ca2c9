"""Rank functions of the trainer's distributed tests (spawned by run_ranks)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from memlm.config.run import compose
from memlm.train.trainer import Trainer


def full_state(model) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def train_on_slices(rank: int, overrides: list[str], batches_path: str, steps: int, out_path: str,
                    world: int) -> None:
    """Each rank trains on its rows of fixed global batches; rank 0 saves losses and weights."""
    batches = torch.load(batches_path, weights_only=True)
    cfg = compose(overrides)
    b = cfg.data.micro_batch
    # (inputs, targets) or (inputs, targets, doc_ids): this rank's rows of each tensor
    mine = iter([tuple(t[rank * b:(rank + 1) * b] for t in batch) for batch in batches])
    trainer = Trainer(cfg, train_loader=mine)
    metrics = [trainer.train_step() for _ in range(steps)]
    state = full_state(trainer.model)
    if rank == 0:
        torch.save({"metrics": metrics, "state": state}, out_path)


def fit(rank: int, overrides: list[str], stop_after: int | None = None) -> None:
    """A whole run, as `python -m memlm.train` would do it on this rank."""
    Trainer(compose(overrides)).fit(stop_after)


def full_optim_state(trainer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(trainer.model, trainer.optimizer,
                                   options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Collective; with cpu_offload only rank 0 receives the full state.
    return {f"{fqn}/{k}": v for fqn, st in osd.get("state", {}).items() for k, v in st.items()}


def fit_and_dump(rank: int, overrides: list[str], out_path: str) -> None:
    """Run (or only restore, with steps reached) and save full model + optimizer state from rank 0."""
    trainer = Trainer(compose(overrides))
    trainer.fit()
    model, optim = full_state(trainer.model), full_optim_state(trainer)
    if rank == 0:
        torch.save({"model": model, "optim": optim, "step": trainer.step}, out_path)


def hybrid_init_shards(rank: int, overrides: list[str], out_dir: str) -> None:
    """Two "nodes" of two ranks (hybrid: shard within, replicate across): each
    rank saves its local shards after a sharded init on meta (run_ranks(..., per_node=2))."""
    trainer = Trainer(compose(overrides))
    local = {k: v.to_local().clone() if hasattr(v, "to_local") else v.detach().clone()
             for k, v in trainer.model.state_dict().items()}
    torch.save(local, f"{out_dir}/rank{rank}.pt")
    trainer.close()


def fit_on(world: int, overrides: list[str], out_path: str) -> None:
    """fit_and_dump on one process or on `world` ranks (the same run, the same dump)."""
    from distributed_workers import run_ranks

    if world == 1:
        fit_and_dump(0, overrides, out_path)
    else:
        run_ranks(fit_and_dump, world, overrides, out_path)


def assert_restored_equal(saved: str, resumed: str, step: int) -> dict:
    """Two fit_and_dump files: the resumed run stopped at `step` and holds every weight and optimizer
    state of the saved one, equal. Returns the saved dump."""
    a, b = torch.load(saved, weights_only=True), torch.load(resumed, weights_only=True)
    assert b["step"] == step
    for part in ("model", "optim"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), f"{part} {k}"
    assert any("exp_avg_sq" in k for k in a["optim"])
    return a
