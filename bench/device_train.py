"""Training-path checks for a lent GPU (bench/device_check.sh runs them one
section at a time, each under its own timeout):

    python bench/device_train.py mfu --json OUT/mfu.json              # bf16 MFU, 373M dense and Memory+
    python bench/device_train.py mfu --mfu-floor 0.2 --peak-tflops 989  # another floor; a GPU not in PEAK_FLOPS
    python bench/device_train.py compile --variant dense --json OUT/c.json  # eager vs parallel.compile=true
    python bench/device_train.py compile --variant memplus            # the same with Memory+ (134M base)
    python bench/device_train.py nosync --json OUT/nosync.json        # no host sync in non-logging steps
    python bench/device_train.py equivalence --json OUT/eq.json       # 2 NCCL ranks == 1 process
    python bench/device_train.py paths --json OUT/paths.json          # CUDA branches (bench/device_paths.py)
    python bench/device_train.py mfu --dry-run                        # tiny models on CPU: checks the code path

Every section builds the real `Trainer` (random tokens, no files read) and
prints one `RESULT <section> ok|FAIL: ...` line that the shell script copies
into its summary (and `PARTIAL` lines as parts finish, kept if a section
runs out of time). The exit status is 0 for ok and 1 for FAIL; an exception
anywhere in a section is a FAIL naming it. Pass/fail rules:

- mfu: every model's MFU >= --mfu-floor (default MFU_FLOOR = 10%) and its
  loss finite. MFU counts model FLOPs (3 x forward, no recomputation) against
  the dense bf16 peak of memlm.train.metrics.PEAK_FLOPS (or --peak-tflops);
  on a GPU with no known peak the section fails (it cannot judge). In a dry
  run on CPU there is no peak: the floor is applied only with --peak-tflops.
- compile: no graph break, at most EXPECTED_GRAPHS[variant] graphs compiled
  in the warm-up and timed steps (one per distinct block; more means
  recompiles), and (on a GPU) compiled step time < eager step time, i.e. a
  speedup > 1. The first compiled step (cold compile) is reported.
- nosync: in every non-logging step, no Tensor method that brings a value to
  the host runs on a device tensor (`.item()`, `.tolist()`, `bool(t)`, ...;
  counted on CPU too), and from the third step on a GPU
  torch.cuda.set_sync_debug_mode("error") raises on no sync either.
- equivalence: losses and weights of 2 ranks within 1e-3 of 1 process.
- paths: every path of bench/device_paths.py raises nothing and ends on a finite loss.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "helpers"))  # the distributed test helpers (equivalence)

from device_paths import section_paths  # noqa: E402
from nosync_watch import watch_fit  # noqa: E402

from memlm.config.run import compose  # noqa: E402
from memlm.train.metrics import device_peak_flops  # noqa: E402
from memlm.train.trainer import Trainer  # noqa: E402

COMMON = ["data=random", "logging.wandb.mode=disabled", "checkpoint.at_end=false", "val_batches=0",
          "optim.warmup=2", "steps=1000", "parallel.memory_parallel=1"]  # one process
# The 373M base (configs/model/373m.yaml) at 2048 tokens x 8 per step, in bf16.
GPU_MODEL = ["model=373m", "data.seq_len=2048", "data.micro_batch=8", "parallel.dtype=bf16"]
# compile: the 134M base at 1024 x 8. Cold compilation costs the same per distinct
# block whatever the width; a smaller model keeps the eager and compiled runs short.
GPU_COMPILE_MODEL = ["model=134m", "data.seq_len=1024", "data.micro_batch=8", "parallel.dtype=bf16"]
GPU_MEMPLUS = ["memory=memplus"]  # 1M slots, 3 layers sharing one pool (the published config)
TINY_MODEL = ["model=tiny", "data.seq_len=64", "data.micro_batch=2", "parallel.dtype=fp32", "device=cpu"]
TINY_MEMPLUS = ["memory=memplus", "memory.layers=[1]", "memory.n_keys=16", "memory.knn=4", "memory.eval_knn=4",
                "memory.heads=2", "memory.k_dim=16"]
TINY_MOE = ["memory=moe", "memory.layers=[1]"]

# The floor of the mfu section. On one H200 (docs/benchmarks.md, "Device
# check"; eager, 8 x 2048 tokens) the 373M dense model in bf16 reached 22%
# and Memory+ (memory-bound reads on top) 13-14%; 10% is what a broken path
# falls under: fp32 matmuls without TF32 (at most 67 / 989 = 6.8% of the bf16
# peak), the Triton interpreter or a CPU fallback,
# or a sync per layer (the GPU idles while the host waits).
MFU_FLOOR = 0.10
# Graphs dynamo compiles with parallel.compile=true (one Module.compile per
# block; identical blocks share one graph): dense blocks, plus the memory blocks.
EXPECTED_GRAPHS = {"dense": 1, "memplus": 2}


def has_cuda() -> bool:
    """Whether a CUDA device is there (the sections' GPU path needs one)."""
    return torch.cuda.is_available()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trainer(overrides: list[str], dump_dir: str) -> Trainer:
    return Trainer(compose([*COMMON, *overrides, f"dump_dir={dump_dir}"]))


def timed_steps(trainer: Trainer, warmup: int, steps: int, peak: float | None = None) -> dict:
    """Tokens/s and MFU of `steps` steps after `warmup` untimed ones; no value
    is read in the timed steps, the loss of one more step is read after.
    peak: FLOP/s to compute MFU against (default: the device's known peak)."""
    for _ in range(warmup):
        trainer.train_step(read=False)
    device = trainer.env.device
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(read=False)
    _sync(device)
    seconds = (time.perf_counter() - start) / steps
    loss = trainer.train_step(read=True).get("loss", float("nan"))
    cfg = trainer.cfg
    tokens = cfg.data.micro_batch * cfg.data.seq_len * trainer.accum
    flops = 3 * trainer.model.flops_per_token(cfg.data.seq_len) * tokens
    peak = peak or device_peak_flops(device)
    out = {"step_s": seconds, "tokens_per_s": tokens / seconds, "tflops": flops / seconds / 1e12, "loss": loss,
           "peak_tflops": peak / 1e12 if peak else None}
    out["mfu"] = flops / seconds / peak if peak else None
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def _variants(dry: bool, gpu_model: list[str] | None = None) -> dict[str, list[str]]:
    """dense and Memory+ overrides: tiny on CPU (dry run), else `gpu_model` (default GPU_MODEL)."""
    base, memplus = (TINY_MODEL, TINY_MEMPLUS) if dry else (gpu_model or GPU_MODEL, GPU_MEMPLUS)
    return {"dense": list(base), "memplus": [*base, *memplus]}


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def judge_mfu(results: dict[str, dict], floor: float, dry: bool) -> list[str]:
    """Reasons to fail the mfu section ([] when it passes)."""
    reasons = []
    for name, r in results.items():
        if not math.isfinite(r["loss"]):
            reasons.append(f"{name}: loss {r['loss']} is not finite")
        if r["mfu"] is None:
            if not dry:
                reasons.append(f"{name}: no bf16 peak known for {_device_name()!r}: add it to "
                               "memlm.train.metrics.PEAK_FLOPS or pass --peak-tflops")
        elif r["mfu"] < floor:
            reasons.append(f"{name}: MFU {r['mfu']:.1%} under the floor {floor:.0%}")
    return reasons


def section_mfu(dry: bool, tmp: str, floor: float = MFU_FLOOR, peak_tflops: float | None = None) -> dict:
    results = {}
    peak = peak_tflops * 1e12 if peak_tflops else None
    for name, overrides in _variants(dry).items():
        trainer = _trainer(overrides, f"{tmp}/{name}")
        results[name] = timed_steps(trainer, 2 if dry else 5, 2 if dry else 15, peak)
        print(f"PARTIAL mfu {name}: {json.dumps(results[name])}", flush=True)  # kept if a later part times out
        del trainer
        _empty_cache()
    reasons = judge_mfu(results, floor, dry)
    line = ", ".join(f"{k} {v['tokens_per_s']:,.0f} tok/s" + (f" MFU {v['mfu']:.1%}" if v["mfu"] else "")
                     for k, v in results.items())
    line += f" (floor {floor:.0%})" if any(v["mfu"] for v in results.values()) else " (no peak: MFU not judged)"
    return {"ok": not reasons, "line": "; ".join(reasons) + f" [{line}]" if reasons else line,
            "results": results, "mfu": {k: v["mfu"] for k, v in results.items()}, "floor": floor}


def dynamo_counts() -> dict:
    """What dynamo compiled since the last counters.clear(): graphs, graph
    breaks (with their reasons) and frames."""
    from torch._dynamo.utils import counters

    breaks = dict(counters["graph_break"])
    return {"graphs": int(counters["stats"]["unique_graphs"]), "graph_breaks": sum(breaks.values()),
            "break_reasons": [str(k).splitlines()[0][:200] for k in breaks][:3],
            "frames": int(counters["frames"]["total"])}


def judge_compile(variant: str, eager_s: float, compiled_s: float, counts: dict, dry: bool) -> list[str]:
    """Reasons to fail the compile section ([] when it passes)."""
    reasons = []
    expected = EXPECTED_GRAPHS[variant]
    if counts["graph_breaks"]:
        reasons.append(f"{counts['graph_breaks']} graph break(s), expected 0: " + " | ".join(counts["break_reasons"]))
    if counts["graphs"] > expected:
        reasons.append(f"{counts['graphs']} graphs compiled, expected at most {expected} (recompiles)")
    if counts["graphs"] == 0:
        reasons.append("nothing was compiled")
    speedup = eager_s / compiled_s
    if not dry and speedup <= 1:
        reasons.append(f"speedup {speedup:.2f}x <= 1 (eager {eager_s * 1e3:.1f} ms, compiled {compiled_s * 1e3:.1f} ms"
                       " per step)")
    return reasons


def section_compile(dry: bool, tmp: str, variant: str) -> dict:
    """Step time of one model eager and with parallel.compile=true, and what
    dynamo compiled for it (counted from a reset, so the compile is cold)."""
    from torch._dynamo.utils import counters

    overrides = _variants(dry, GPU_COMPILE_MODEL)[variant]
    results = {}
    for mode in ("eager", "compiled"):
        if mode == "compiled":
            torch._dynamo.reset()
            counters.clear()
        extra = ["parallel.compile=true"] if mode == "compiled" else []
        trainer = _trainer([*overrides, *extra], f"{tmp}/{variant}-{mode}")
        start = time.perf_counter()
        trainer.train_step(read=False)  # the compilation happens here
        _sync(trainer.env.device)
        first = time.perf_counter() - start
        results[mode] = {**timed_steps(trainer, 1 if dry else 2, 2 if dry else 6), "first_step_s": first}
        print(f"PARTIAL compile {variant}/{mode}: {json.dumps(results[mode])}", flush=True)
        del trainer
        _empty_cache()
    counts = dynamo_counts()
    eager_s, compiled_s = results["eager"]["step_s"], results["compiled"]["step_s"]
    reasons = judge_compile(variant, eager_s, compiled_s, counts, dry)
    speedup = eager_s / compiled_s
    line = (f"{variant} {speedup:.2f}x{' (not judged in a dry run)' if dry else ''}, {counts['graphs']} graph(s), "
            f"{counts['graph_breaks']} break(s), first compiled step {results['compiled']['first_step_s']:.0f} s")
    return {"ok": not reasons, "line": "; ".join(reasons) + f" [{line}]" if reasons else line,
            "results": results, "speedup": speedup, "dynamo": counts}


def section_nosync(dry: bool, tmp: str) -> dict:
    """Memory+ and MoE trained with `fit` (12 steps, logging every 5th) under
    watch_fit. On CPU (dry run) the host-read counter is the check."""
    cuda = torch.cuda.is_available() and not dry
    base = TINY_MODEL if dry else ["model=134m", "data.seq_len=1024", "data.micro_batch=4", "parallel.dtype=bf16"]
    memplus = TINY_MEMPLUS if dry else ["memory=memplus", "memory.layers=[]", "memory.spread=3"]
    moe = TINY_MOE if dry else ["memory=moe"]
    results, steps = {}, 12
    for name, overrides in {"memplus": [*base, *memplus], "moe": [*base, *moe]}.items():
        trainer = Trainer(compose([*COMMON, *overrides, f"steps={steps}", "logging.every=5",
                                   f"dump_dir={tmp}/nosync-{name}"]))
        results[name] = watch_fit(trainer, cuda)
        del trainer
        _empty_cache()
    reasons = [f"{k}: {v['n_syncs']} host read(s)/sync(s), first {v['syncs'][0]}" for k, v in results.items()
               if v["syncs"]]
    reasons += [f"{k}: stopped after {v['steps']} of {steps} steps" for k, v in results.items()
                if v["steps"] != steps and not v["syncs"]]
    line = "; ".join(reasons) or "; ".join(f"{k}: no sync in {v['steps']} steps" for k, v in results.items())
    if not cuda:
        line += " (host reads counted; no CUDA sync debug mode on CPU)"
    return {"ok": not reasons, "line": line, "results": results}


def section_equivalence(dry: bool, tmp: str) -> dict:
    """2 ranks (NCCL on 2 GPUs; gloo in a dry run) with memory_parallel=2 train
    like one process on the concatenated batch: losses, gradient norms and
    weights after 3 steps (the check of tests/integration/test_train_equivalence.py)."""
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
    ref_trainer = Trainer(compose([*overrides, "data.micro_batch=4", "parallel.memory_parallel=1",
                                   f"dump_dir={tmp}/ref"]), train_loader=iter(batches))  # one process
    ref = [ref_trainer.train_step() for _ in range(3)]
    ref_state = full_state(ref_trainer.model)
    torch.save(batches, f"{tmp}/batches.pt")
    run_ranks(train_on_slices, 2, [*overrides, "data.micro_batch=2", "parallel.memory_parallel=2",
                                   f"dump_dir={tmp}/dist"], f"{tmp}/batches.pt", 3, f"{tmp}/dist.pt", 2, device=device)
    got = torch.load(f"{tmp}/dist.pt", weights_only=True)
    loss_diff = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(ref, got["metrics"]))
    weight_diff = max((v.float().cpu() - got["state"][k].float().cpu()).abs().max().item()
                      for k, v in ref_state.items())
    # fp32 on both sides; TF32 matmuls (if enabled) and the NCCL reduction
    # order move results by ~1e-4, not more.
    ok = loss_diff <= 1e-3 and weight_diff <= 1e-3
    line = f"loss rel diff {loss_diff:.2e}, max weight diff {weight_diff:.2e} (limit 1e-3)"
    return {"ok": ok, "line": line if ok else f"2 ranks differ from 1 process: {line}",
            "loss_rel_diff": loss_diff, "weight_max_diff": weight_diff}


SECTIONS = {"mfu": section_mfu, "compile": section_compile, "nosync": section_nosync,
            "equivalence": section_equivalence, "paths": section_paths}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("section", choices=sorted(SECTIONS))
    parser.add_argument("--dry-run", action="store_true", help="tiny models on CPU (no GPU needed)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--variant", choices=sorted(EXPECTED_GRAPHS), default="dense",
                        help="compile: the model to compile (default dense)")
    parser.add_argument("--mfu-floor", type=float, default=MFU_FLOOR,
                        help=f"mfu: the lowest passing MFU, a fraction (default {MFU_FLOOR})")
    parser.add_argument("--peak-tflops", type=float,
                        help="mfu: dense bf16 peak TFLOP/s of the device (default: memlm.train.metrics.PEAK_FLOPS)")
    args = parser.parse_args(argv)
    name = f"compile_{args.variant}" if args.section == "compile" else args.section
    if not 0 <= args.mfu_floor < 1:
        parser.error(f"--mfu-floor {args.mfu_floor}: valid is a fraction in [0, 1)")
    if not args.dry_run and not has_cuda():
        print(f"RESULT {name} FAIL: no CUDA device (use --dry-run on CPU)", flush=True)
        return 1
    kwargs = {"mfu": {"floor": args.mfu_floor, "peak_tflops": args.peak_tflops},
              "compile": {"variant": args.variant}}.get(args.section, {})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result = SECTIONS[args.section](args.dry_run, tmp, **kwargs)
    except Exception as err:  # noqa: BLE001 - any error fails the section, named
        traceback.print_exc()
        result = {"ok": False, "line": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    print(f"RESULT {name} {'ok' if result['ok'] else 'FAIL'}: {result['line']}", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
