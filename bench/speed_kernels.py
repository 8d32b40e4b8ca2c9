"""The memory read's kernels at the paper's read, fp32 and bf16 tables (bench/gpu_speed.py kernels).

    result = part_kernels(dry, official_dir, repeats, record)   # record(result) after every row

For each table dtype (float32, the 373M run's, then bfloat16) at
GPU_SHAPE: every variant checked against a float32 F.embedding_bag, then
timed forward, backward (both gradients from a given output gradient) and
forward+backward (autograd): our "segments" kernels (dense gradient, the
accumulation into a gradient buffer, the sparse gradient), the first
kernels ("by_slot", "atomic": bench/bag_variants.py), the torch path,
F.embedding_bag and the official kernel (--official). Beside them:
- copy: a device-to-device copy of a table-sized tensor, the bandwidth a
  read can hope for (bytes read + written / time);
- L2-resident: the forward over L2_SLOTS slots (the table fits in L2);
- hot slots: HOT_SHARE of the reads on HOT_SLOTS slots (a few rows take most
  reads: their segments are the longest), the backward of ours.
Our variants off the reference fail the part; the official kernel's
problems are reported beside them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F
from kernels import checked, fwd_bytes, make_case, measure, reference

# tokens, reads per token (heads x knn), slots, v_dim: the paper's read; the dry run's
# (v_dim a power of two: the official kernel needs one).
GPU_SHAPE = (16384, 128, 1 << 20, 1024)
DRY_SHAPE = (16, 8, 64, 64)
DTYPES = (torch.float32, torch.bfloat16)
L2_SLOTS = 4096            # 4,096 x 1024 x 4 B = 16 MiB: inside an H100's (50 MB) or H200's L2
HOT_SLOTS, HOT_SHARE = 32, 0.9
COPY_BYTES = 1 << 32       # the fp32 table's size
# Issue #49's kernel goals (reported, never a FAIL): forward bandwidth on an H200, else this share of the copy.
GOAL_FWD_GBS_H200 = 3000.0
GOAL_FWD_COPY_SHARE = 0.85
GOAL_FWD_BWD_MS = 6.0
ALGORITHM_NOTE = {"segments": "the default: whole rows; blocked by-slot walk, weights' gradient fused",
                  "segments accumulate": "the default in training: added into the table's gradient buffer",
                  "segments busiest-first": "the longest segments first, one per program",
                  "by_slot": "the first kernels", "atomic": "the first forward, atomic table gradient"}


def load_official(path: Path | None):
    """The official module (xformer_embeddingbag.py in `path`), or None."""
    if path is None:
        return None
    file = path / "xformer_embeddingbag.py" if path.is_dir() else path
    spec = importlib.util.spec_from_file_location("official_xformer_embeddingbag", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hot_case(shape, dtype, device, seed=1):
    """make_case with HOT_SHARE of the reads on HOT_SLOTS slots."""
    values, indices, weights, grad_out = make_case(shape, dtype, device, seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    hot = torch.rand(indices.shape, device=device, generator=gen) < HOT_SHARE
    few = torch.randint(0, min(HOT_SLOTS, shape[2]), indices.shape, device=device, generator=gen)
    return values, torch.where(hot, few, indices), weights, grad_out


def forward_variants(case, official) -> dict:
    """name -> callable returning the output (B, V)."""
    import bag_variants

    from memlm.memory.fast import triton_bag

    values, indices, weights, _ = (t.detach() for t in case)
    fns = {"segments": lambda: triton_bag.bag_forward(values, indices, weights),
           "by_slot": lambda: bag_variants.bag_forward_by_slot(values, indices, weights),
           "F.embedding_bag": lambda: F.embedding_bag(indices, values, per_sample_weights=weights.to(values.dtype),
                                                      mode="sum")}
    if official is not None:
        fns["official"] = lambda: official.embedding_bag_triton(indices, values, weights)
    return fns


def backward_variants(case, official) -> dict:
    """name -> callable returning (table gradient, weights' gradient) from the output gradient."""
    import bag_variants

    from memlm.memory.fast import ops, triton_bag

    values, indices, weights, grad_out = (t.detach() for t in case)
    buffer = torch.zeros_like(values)

    def accumulate():
        buffer.zero_()  # one read's gradient: the buffer starts at zero (a table-sized memset, timed with it)
        return buffer, triton_bag.accumulate_gradients(values, buffer, indices, weights, grad_out)

    busiest = triton_bag.segments_launch(values.shape[1], values.dtype)._replace(busiest_first=True)

    def busiest_first():
        order, seg_start, _ = triton_bag.group_by_slot(indices, values.shape[0])
        return triton_bag.segment_gradients(values, grad_out, order, seg_start, None, weights, True, busiest)

    fns = {"segments": lambda: triton_bag.gradients(values, indices, weights, grad_out),
           "segments busiest-first": busiest_first,
           "segments accumulate": accumulate,
           "segments sparse": lambda: triton_bag.gradients(values, indices, weights, grad_out, sparse=True),
           "by_slot": lambda: bag_variants.gradients_by_slot(values, indices, weights, grad_out),
           "atomic": lambda: bag_variants.gradients_atomic(values, indices, weights, grad_out),
           "torch": lambda: ops._bag_gradients(grad_out, values, indices, weights, False, "torch", True, True)}
    if official is not None:
        fns["official"] = lambda: official.embedding_bag_bw_rev_indices(indices, values, weights, grad_out)
        fns["official atomics"] = lambda: official.embedding_bag_bw2(indices, values, weights, grad_out, True)
    return fns


def train_variants(case, official) -> dict:
    """name -> callable running forward + backward through autograd: (out, table grad, weights' grad)."""
    import bag_variants

    from memlm.memory.fast import ops

    values, indices, weights, grad_out = case

    def run(read):
        out = read()
        return (out, *torch.autograd.grad(out, (values, weights), grad_out))

    fns = {"segments": lambda: run(lambda: ops.embedding_bag(values, indices, weights, kernel="triton")),
           "by_slot": lambda: run(lambda: bag_variants.embedding_bag_by_slot(values, indices, weights)),
           "atomic": lambda: run(lambda: bag_variants.embedding_bag_atomic(values, indices, weights)),
           "torch": lambda: run(lambda: ops.embedding_bag(values, indices, weights, kernel="torch"))}
    if official is not None:
        fns["official"] = lambda: run(lambda: official.xformers_embedding_bag(indices, values, weights))
    return fns


def copy_baseline(device: str, timer, repeats: int, nbytes: int) -> dict:
    """Device-to-device copy of `nbytes`: GB/s counting the bytes read and written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    sec = timer(lambda: dst.copy_(src), repeats)
    return dict(bytes=nbytes, ms=sec * 1e3, gbs=2 * nbytes / sec / 1e9)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def dtype_rows(dtype, shape, device, official, timer, repeats, failures, notes, record) -> None:
    """The three passes of every variant at `shape` with a `dtype` table, then the L2 and hot cases."""
    from memlm.memory.fast import triton_bag

    case = make_case(shape, dtype, device)
    ref = reference(case)
    nbytes = fwd_bytes(shape, dtype)
    name = _dtype_name(dtype)
    passes = (("fwd", forward_variants, (0,)), ("bwd", backward_variants, (1, 2)),
              ("fwd+bwd", train_variants, (0, 1, 2)))
    for pass_, make, which in passes:
        for variant, fn in make(case, official).items():
            ours = not (variant.startswith("official") or variant == "F.embedding_bag")
            # The comparison-only variants get a third of the timed calls (the run's minutes are few).
            reps = repeats if variant.startswith(("segments", "official")) else max(1, repeats // 3)  # as "repeats"
            sec = measure(f"{name} {pass_} {variant}", fn, ref, which, timer, reps, failures, notes, ours, dtype)
            if sec is None:
                continue
            gbs = nbytes / sec / 1e9 if pass_ == "fwd" else None
            record("rows", dict(dtype=name, case="uniform", name=variant, pass_=pass_, ms=sec * 1e3, gbs=gbs))
            print(f"{name:8s} {pass_:7s} {variant:20s} {sec * 1e3:9.3f} ms" + (f"  {gbs:6.0f} GB/s" if gbs else ""),
                  flush=True)
    del case, ref
    _free()
    tokens, reads, _, v_dim = shape
    small = (tokens, reads, min(L2_SLOTS, shape[2]), v_dim)
    case = make_case(small, dtype, device)
    ref = reference(case)
    values, indices, weights, _ = (t.detach() for t in case)
    sec = measure(f"{name} fwd segments L2", lambda: triton_bag.bag_forward(values, indices, weights), ref, (0,),
                  timer, repeats, failures, notes, True, dtype)
    if sec is not None:
        record("rows", dict(dtype=name, case="L2-resident", name="segments", pass_="fwd", ms=sec * 1e3,
                            gbs=nbytes / sec / 1e9))
    case = hot_case(shape, dtype, device)
    ref = reference(case)
    for variant, fn in backward_variants(case, None).items():
        if variant not in ("segments", "segments busiest-first", "segments accumulate", "atomic"):
            continue
        sec = measure(f"{name} bwd {variant} hot", fn, ref, (1, 2), timer, repeats, failures, notes, True, dtype)
        if sec is not None:
            record("rows", dict(dtype=name, case="hot slots", name=variant, pass_="bwd", ms=sec * 1e3, gbs=None))
            print(f"{name:8s} bwd hot   {variant:20s} {sec * 1e3:9.3f} ms", flush=True)
    del case, ref
    _free()


def _free() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def part_kernels(dry: bool, official_dir: Path | None, repeats: int, timer, record) -> dict:
    """The kernels part; record(key, value) appends a row ("rows") or sets a value, and writes the JSON."""
    device = "cpu" if dry else "cuda"
    shape = DRY_SHAPE if dry else GPU_SHAPE
    failures, notes = [], []
    official = checked("official import", notes, lambda: load_official(official_dir)) if official_dir else None
    if official_dir is None:
        (notes if dry else failures).append("the official kernel was not given (--official DIR: "
                                            "bench/official_kernel.sh makes it)")
    record("shape", list(shape))
    record("repeats", [repeats, max(1, repeats // 3)])
    copy = checked("copy", failures, lambda: copy_baseline(device, timer, repeats, 1 << 20 if dry else COPY_BYTES))
    record("copy", copy)
    for dtype in DTYPES:
        dtype_rows(dtype, shape, device, official, timer, repeats, failures, notes, record)
        record("failures", failures)
        record("notes", notes)
    return {"failures": failures, "notes": notes}


def kernel_goals(rows, copy: dict | None, device_name: str) -> dict:
    """Issue #49's kernel goals, bf16 table, uniform reads: met / not met."""
    ms = {(r["name"], r["pass_"]): r["ms"] for r in rows if r["dtype"] == "bfloat16" and r["case"] == "uniform"}
    gbs = {r["name"]: r["gbs"] for r in rows if r["dtype"] == "bfloat16" and r["case"] == "uniform" and r["gbs"]}
    goals = {}
    if "segments" in gbs:
        if "H200" in device_name:
            floor, what = GOAL_FWD_GBS_H200, "3.0 TB/s"
        elif copy:
            floor, what = GOAL_FWD_COPY_SHARE * copy["gbs"], f"85% of the copy ({copy['gbs']:.0f} GB/s)"
        else:
            floor = None
        if floor:
            goals[f"forward >= {what}"] = (f"{'met' if gbs['segments'] >= floor else 'not met'} "
                                           f"({gbs['segments']:.0f} GB/s)")
    if ("segments", "fwd+bwd") in ms:
        t = ms[("segments", "fwd+bwd")]
        goals[f"fwd+bwd <= {GOAL_FWD_BWD_MS:g} ms"] = f"{'met' if t <= GOAL_FWD_BWD_MS else 'not met'} ({t:.2f} ms)"
    for pass_ in ("fwd", "bwd", "fwd+bwd"):
        if ("official", pass_) in ms and ("segments", pass_) in ms:
            ours, theirs = ms[("segments", pass_)], ms[("official", pass_)]
            goals[f"{pass_} vs official"] = f"{'met' if ours <= theirs else 'not met'} ({theirs / ours:.2f}x)"
    return goals


def kernels_markdown(result: dict, header: str) -> str:
    tokens, reads, slots, v_dim = result["shape"]
    ours, others = result.get("repeats", ["?", "?"])
    rows = result.get("rows", [])
    lines = [header, "",
             f"{tokens:,} tokens x {reads} reads, {slots:,} slots, v_dim {v_dim}, fp32 weights; median of the "
             f"timed calls ({ours} for ours and the official kernel, {others} for the others); every variant "
             "checked against a float32 F.embedding_bag first. bwd: both gradients from a given output gradient "
             "(sort included); fwd+bwd: through autograd. L2-resident: "
             f"{L2_SLOTS:,} slots; hot slots: {HOT_SHARE:.0%} of the reads on {HOT_SLOTS} slots."]
    if result.get("copy"):
        c = result["copy"]
        lines += ["", f"Copy baseline: {c['bytes'] / 2**20:,.0f} MiB copied in {c['ms']:.3f} ms, "
                      f"{c['gbs']:.0f} GB/s (read + written)."]
    lines += ["", "| table | case | variant | pass | time | effective bandwidth | official / this |",
              "|---|---|---|---|---:|---:|---:|"]
    official = {(r["dtype"], r["pass_"]): r["ms"] for r in rows if r["name"] == "official" and r["case"] == "uniform"}
    for r in rows:
        note = f" ({ALGORITHM_NOTE[r['name']]})" if r["name"] in ALGORITHM_NOTE and r["case"] == "uniform" else ""
        key = (r["dtype"], r["pass_"])
        ratio = f"{official[key] / r['ms']:.2f}x" if key in official and r["case"] == "uniform" else "-"
        bandwidth = f"{r['gbs']:.0f} GB/s" if r.get("gbs") else "-"
        lines.append(f"| {r['dtype']} | {r['case']} | {r['name']}{note} | {r['pass_']} | {r['ms']:.3f} ms | "
                     f"{bandwidth} | {ratio} |")
    notes = [f"- {k}: {v}." for k, v in result.get("goals", {}).items()]
    notes += [f"- Not measured: {n}." for n in result.get("notes", [])]
    return "\n".join(lines + ([""] + notes if notes else []))

