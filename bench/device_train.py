"""Training-path checks for a lent GPU (bench/device_check.sh runs them one
section at a time, each under its own timeout):

    python bench/device_train.py mfu --json OUT/mfu.json          # bf16 MFU, 373M dense and Memory+
    python bench/device_train.py compile --json OUT/compile.json  # eager vs parallel.compile=true
    python bench/device_train.py nosync --json OUT/nosync.json    # no host sync in non-logging steps
    python bench/device_train.py equivalence --json OUT/eq.json   # 2 NCCL ranks == 1 process
    python bench/device_train.py mfu --dry-run                    # tiny models on CPU: checks the code path

Every section builds the real `Trainer` (random tokens, no files read) and
prints one `RESULT <section> ok|FAIL: ...` line that the shell script copies
into its summary (and `PARTIAL` lines as parts finish, kept if a section
runs out of time). MFU counts model FLOPs (3 x forward, no recomputation)
against the dense bf16 peak of memlm.train.metrics.PEAK_FLOPS.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the distributed test helpers (equivalence)

from memlm.train.config import compose  # noqa: E402
from memlm.train.metrics import device_peak_flops  # noqa: E402
from memlm.train.trainer import Trainer  # noqa: E402

COMMON = ["data=random", "logging.wandb.mode=disabled", "checkpoint.at_end=false", "val_batches=0",
          "optim.warmup=2", "steps=1000"]
# The 373M base (configs/model/373m.yaml) at 2048 tokens x 8 per step, in bf16.
GPU_MODEL = ["model=373m", "data.seq_len=2048", "data.micro_batch=8", "parallel.dtype=bf16"]
GPU_MEMPLUS = ["memory=memplus"]  # 1M slots, 3 layers sharing one pool (the published config)
TINY_MODEL = ["model=tiny", "data.seq_len=64", "data.micro_batch=2", "parallel.dtype=fp32", "device=cpu"]
TINY_MEMPLUS = ["memory=memplus", "memory.layers=[1]", "memory.n_keys=16", "memory.knn=4", "memory.eval_knn=4",
                "memory.heads=2", "memory.k_dim=16"]
TINY_MOE = ["memory=moe", "memory.layers=[1]"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trainer(overrides: list[str], dump_dir: str) -> Trainer:
    return Trainer(compose([*COMMON, *overrides, f"dump_dir={dump_dir}"]))


def timed_steps(trainer: Trainer, warmup: int, steps: int) -> dict:
    """Tokens/s and MFU of `steps` steps after `warmup` untimed ones."""
    for _ in range(warmup):
        trainer.train_step()
    device = trainer.env.device
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    _sync(device)
    seconds = (time.perf_counter() - start) / steps
    cfg = trainer.cfg
    tokens = cfg.data.micro_batch * cfg.data.seq_len * trainer.accum
    flops = 3 * trainer.model.flops_per_token(cfg.data.seq_len) * tokens
    peak = device_peak_flops(device)
    out = {"step_s": seconds, "tokens_per_s": tokens / seconds, "tflops": flops / seconds / 1e12}
    out["mfu"] = flops / seconds / peak if peak else None
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def _variants(dry: bool) -> dict[str, list[str]]:
    base, memplus = (TINY_MODEL, TINY_MEMPLUS) if dry else (GPU_MODEL, GPU_MEMPLUS)
    return {"dense": list(base), "memplus": [*base, *memplus]}


def section_mfu(dry: bool, tmp: str) -> dict:
    results = {}
    for name, overrides in _variants(dry).items():
        trainer = _trainer(overrides, f"{tmp}/{name}")
        results[name] = timed_steps(trainer, 2 if dry else 5, 2 if dry else 15)
        print(f"PARTIAL mfu {name}: {json.dumps(results[name])}", flush=True)  # kept if a later part times out
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    mfus = {k: v["mfu"] for k, v in results.items()}
    ok = all(v["step_s"] > 0 for v in results.values())
    line = ", ".join(f"{k} {v['tokens_per_s']:,.0f} tok/s" + (f" MFU {v['mfu']:.1%}" if v["mfu"] else "")
                     for k, v in results.items())
    return {"ok": ok, "line": line, "results": results, "mfu": mfus}


def section_compile(dry: bool, tmp: str) -> dict:
    results = {}
    for name, overrides in _variants(dry).items():
        for mode in ("eager", "compiled"):
            extra = ["parallel.compile=true"] if mode == "compiled" else []
            trainer = _trainer([*overrides, *extra], f"{tmp}/{name}-{mode}")
            start = time.perf_counter()
            trainer.train_step()  # the compilation happens here
            _sync(trainer.env.device)
            first = time.perf_counter() - start
            results[f"{name}/{mode}"] = {**timed_steps(trainer, 1 if dry else 2, 2 if dry else 6),
                                         "first_step_s": first}
            print(f"PARTIAL compile {name}/{mode}: {json.dumps(results[f'{name}/{mode}'])}", flush=True)
            del trainer
    speedup = {name: results[f"{name}/eager"]["step_s"] / results[f"{name}/compiled"]["step_s"]
               for name in _variants(dry)}
    line = ", ".join(f"{k} {v:.2f}x (first compiled step {results[k + '/compiled']['first_step_s']:.0f} s)"
                     for k, v in speedup.items())
    return {"ok": True, "line": line, "results": results, "speedup": speedup}


def section_nosync(dry: bool, tmp: str) -> dict:
    """Run `fit` with torch.cuda.set_sync_debug_mode("error") from the start of
    every non-logging step until the next step starts (the loop's own per-step
    work included); logging steps run in the default mode. On CPU (dry run)
    the mode cannot be set: the same wrapper runs without it."""
    cuda = torch.cuda.is_available() and not dry
    base = TINY_MODEL if dry else ["model=134m", "data.seq_len=1024", "data.micro_batch=4", "parallel.dtype=bf16"]
    memplus = TINY_MEMPLUS if dry else ["memory=memplus", "memory.layers=[]", "memory.spread=3"]
    moe = TINY_MOE if dry else ["memory=moe"]
    results = {}
    for name, overrides in {"memplus": [*base, *memplus], "moe": [*base, *moe]}.items():
        every = 5
        trainer = Trainer(compose([*COMMON, *overrides, "steps=12", f"logging.every={every}",
                                   f"dump_dir={tmp}/nosync-{name}"]))
        step, failure = trainer.train_step, []

        def guarded(*args, step=step, trainer=trainer, failure=failure, every=every, **kwargs):
            logging_step = (trainer.step + 1) % every == 0 or trainer.step + 1 == trainer.cfg.steps
            if cuda:
                torch.cuda.set_sync_debug_mode("default" if logging_step or trainer.step < 2 else "error")
            try:
                return step(*args, **kwargs)
            except RuntimeError as err:
                failure.append(f"step {trainer.step + 1}: {str(err).splitlines()[0]}")
                raise

        trainer.train_step = guarded
        try:
            trainer.fit()
        except RuntimeError as err:  # a sync in the loop's own per-step work, outside train_step
            if not failure:
                failure.append(f"after step {trainer.step}: {str(err).splitlines()[0]}")
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        results[name] = {"steps": trainer.step, "syncs": failure[:1]}
    ok = all(not r["syncs"] for r in results.values())
    line = "; ".join(f"{k}: " + ("no sync" if not v["syncs"] else v["syncs"][0]) for k, v in results.items())
    if not cuda:
        line += " (dry run: sync debug mode not set)"
    return {"ok": ok, "line": line, "results": results}


def section_equivalence(dry: bool, tmp: str) -> dict:
    """2 ranks (NCCL on 2 GPUs; gloo in a dry run) with memory_parallel=2 train
    like one process on the concatenated batch: losses, gradient norms and
    weights after 3 steps (the check of tests/test_train_equivalence.py)."""
    from distributed_workers import run_ranks
    from train_workers import full_state, train_on_slices

    if not dry and torch.cuda.device_count() < 2:
        return {"ok": True, "skipped": True, "line": f"skipped: {torch.cuda.device_count()} GPU(s), needs 2"}
    device = "cpu" if dry else "cuda"
    overrides = ["model.vocab_size=128", "model.n_layers=4", "data.seq_len=16", "optim.warmup=0",
                 "optim.lr=1e-3", "optim.eps=1e-5", "optim.clip=0.5", "logging.wandb.mode=disabled",
                 "checkpoint.at_end=false", "memory=memplus", "memory.layers=[1,3]", "memory.n_keys=8",
                 "memory.knn=4", "memory.eval_knn=4", "memory.heads=2", "memory.k_dim=16",
                 "parallel.dtype=fp32", f"device={device}"]
    gen = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(3):
        t = torch.randint(0, 128, (4, 17), generator=gen)
        batches.append((t[:, :-1], t[:, 1:]))
    ref_trainer = Trainer(compose([*overrides, "data.micro_batch=4", f"dump_dir={tmp}/ref"]),
                          train_loader=iter(batches))
    ref = [ref_trainer.train_step() for _ in range(3)]
    ref_state = full_state(ref_trainer.model)
    torch.save(batches, f"{tmp}/batches.pt")
    run_ranks(train_on_slices, 2, [*overrides, "data.micro_batch=2", "parallel.memory_parallel=2",
                                   f"dump_dir={tmp}/dist"], f"{tmp}/batches.pt", 3, f"{tmp}/dist.pt", 2)
    got = torch.load(f"{tmp}/dist.pt", weights_only=True)
    loss_diff = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(ref, got["metrics"]))
    weight_diff = max((v.float().cpu() - got["state"][k].float().cpu()).abs().max().item()
                      for k, v in ref_state.items())
    # fp32 on both sides; TF32 matmuls (if enabled) and the NCCL reduction
    # order move results by ~1e-4, not more.
    ok = loss_diff <= 1e-3 and weight_diff <= 1e-3
    return {"ok": ok, "line": f"loss rel diff {loss_diff:.2e}, max weight diff {weight_diff:.2e} (limit 1e-3)",
            "loss_rel_diff": loss_diff, "weight_max_diff": weight_diff}


SECTIONS = {"mfu": section_mfu, "compile": section_compile, "nosync": section_nosync,
            "equivalence": section_equivalence}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("section", choices=sorted(SECTIONS))
    parser.add_argument("--dry-run", action="store_true", help="tiny models on CPU (no GPU needed)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(f"RESULT {args.section} FAIL: no CUDA device (use --dry-run on CPU)", flush=True)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        result = SECTIONS[args.section](args.dry_run, tmp)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    print(f"RESULT {args.section} {'ok' if result['ok'] else 'FAIL'}: {result['line']}", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
