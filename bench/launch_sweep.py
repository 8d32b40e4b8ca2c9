"""The "segments" kernels' launch sweep (bench/gpu_speed.py sweep; bench/kernels.py without --no-sweep).

    result = sweep(case, ref, repeats, failures, timer, record)     # {"forward": [...], "segments": [...], ...}
    best_launches(result)          # {"forward": Launch, "segments": Launch}: the fastest checked candidate
    config_overrides(result)       # the same as memory.triton_forward / triton_backward overrides

Every candidate is checked against the float32 reference first, then timed.
A candidate whose compiled code is identical to an earlier one's (Triton's
cache gives the same cubin) is not timed again: it is recorded as "same code
as" that launch. The candidates vary BLOCK_B (BLOCK_S), BLOCK_K, num_warps
maxnreg (the registers a thread may use: None = the compiler's choice) and,
for the backward, busiest_first (the longest segments first, one per program);
BLOCK_D is the rule's (whole rows) and num_stages 1 (the kernels prefetch by
hand: 2 and 3 compiled to the same code). The backward includes 1-warp
programs.
"""

from __future__ import annotations

import hashlib

import torch
from kernels import checked, fwd_bytes, measure, time_cuda

# (BLOCK_B, BLOCK_K, num_warps, maxnreg) of the forward; (BLOCK_S, BLOCK_K, num_warps, maxnreg,
# busiest_first) of the backward.
FORWARD_SWEEP = ((1, 4, 4, None), (1, 8, 4, None), (1, 16, 4, None), (1, 8, 8, None), (1, 16, 8, None),
                 (2, 8, 4, None), (1, 8, 2, None), (1, 8, 4, 128), (1, 16, 4, 128), (1, 16, 8, 128),
                 (1, 16, 4, 255), (1, 32, 4, 255))
SEGMENTS_SWEEP = ((8, 4, 4, None, False), (4, 4, 4, None, False), (16, 4, 4, None, False), (32, 4, 4, None, False),
                  (8, 2, 4, None, False), (8, 8, 4, None, False), (8, 4, 2, None, False), (8, 4, 8, None, False),
                  (16, 2, 2, None, False), (8, 4, 1, None, False), (16, 4, 1, None, False), (32, 2, 1, None, False),
                  (8, 4, 4, 128, False), (8, 4, 1, 255, False), (8, 4, 4, None, True), (8, 4, 1, None, True))


def candidates(base, sweep) -> list:
    """The rule's launch `base` first, then each of `sweep` on its BLOCK_D; repeats dropped."""
    fields = ("block_b", "block_k", "num_warps", "maxnreg", "busiest_first")
    out = [base] + [base._replace(num_stages=1, **dict(zip(fields, c))) for c in sweep]
    return list(dict.fromkeys(out))


def compiled_code(jit_fn) -> dict:
    """{cache key: sha1 of the cubin (or PTX)} of what Triton compiled for `jit_fn`
    so far; {} under the interpreter or where the cache is not reachable."""
    out = {}
    try:  # Triton's cache layout is not an API: anything unexpected means no dedupe, not a failure
        for device, entry in (getattr(jit_fn, "device_caches", None) or {}).items():
            cache = entry[0] if isinstance(entry, tuple) and entry and isinstance(entry[0], dict) else {}
            for key, kernel in cache.items():
                asm = getattr(kernel, "asm", None) or {}
                code = asm.get("cubin") or asm.get("ptx")
                if code:
                    out[(device, key)] = hashlib.sha1(code if isinstance(code, bytes) else code.encode()).hexdigest()
    except Exception:  # noqa: BLE001
        return {}
    return out


class SameCode:
    """Tracks which compiled code each candidate launched: `new_code(jit_fn)`
    after a candidate's first call gives the hash it added (None if none)."""

    def __init__(self):
        self.seen: dict = {}      # cache key -> hash
        self.owner: dict = {}     # hash -> the first launch that compiled it

    def new_code(self, jit_fn) -> str | None:
        now = compiled_code(jit_fn)
        added = [h for k, h in now.items() if k not in self.seen]
        self.seen.update(now)
        return added[0] if len(added) == 1 else None


def _run_candidates(what, launches, call, jit_fn, ref, which, timer, repeats, failures, dtype, nbytes, record):
    rows, same = [], SameCode()
    same.new_code(jit_fn)  # what was compiled before the sweep
    for launch in launches:
        label = f"sweep {what} {tuple(launch)}"
        first = checked(label, failures, lambda la=launch: call(la))
        if first is None:
            continue
        code = same.new_code(jit_fn)
        if code is not None and code in same.owner:
            rows.append(dict(launch=list(launch), same_code_as=list(same.owner[code])))
            print(f"{label}: same code as {tuple(same.owner[code])}, not timed", flush=True)
            record(rows)
            continue
        if code is not None:
            same.owner[code] = launch
        sec = measure(label, lambda la=launch: call(la), ref, which, timer, repeats, failures, [], True, dtype)
        if sec is None:
            continue
        row = dict(launch=list(launch), ms=sec * 1e3)
        if nbytes:
            row["gbs"] = nbytes / sec / 1e9
        rows.append(row)
        print(f"{label}: {sec * 1e3:.3f} ms" + (f", {row['gbs']:.0f} GB/s" if nbytes else ""), flush=True)
        record(rows)
    return rows


def sweep(case, ref, repeats: int, failures: list[str], timer=time_cuda, record=lambda part, value: None) -> dict:
    """The forward and backward ("segments") candidates at `case`, each checked then timed.
    record(part, value) is called as rows finish (a caller writes its JSON there)."""
    from memlm.memory.fast import launches, triton_bag

    values, indices, weights, grad_out = (t.detach() for t in case)
    tokens, reads = indices.shape
    dtype = values.dtype
    out = {"forward": [], "segments": [], "sort_ms": None, "elem_bytes": values.element_size(),
           "dtype": str(dtype).split(".")[-1]}
    base_f = launches.forward_launch(values.shape[1], reads, tokens, dtype)
    out["forward"] = _run_candidates(
        "forward", candidates(base_f, FORWARD_SWEEP),
        lambda la: triton_bag.bag_forward(values, indices, weights, launch=la), triton_bag._rows_forward_kernel,
        ref, (0,), timer, repeats, failures, dtype, fwd_bytes((tokens, reads, *values.shape), dtype),
        lambda rows: record("forward", rows))
    sort = checked("sort", failures, lambda: timer(lambda: triton_bag.group_by_slot(indices, values.shape[0]),
                                                   repeats))
    out["sort_ms"] = None if sort is None else sort * 1e3
    order, seg_start, _ = triton_bag.group_by_slot(indices, values.shape[0])
    base_s = launches.segments_launch(values.shape[1], dtype)
    out["segments"] = _run_candidates(
        "segments", candidates(base_s, SEGMENTS_SWEEP),
        lambda la: triton_bag.segment_gradients(values, grad_out, order, seg_start, None, weights, True, la),
        triton_bag._segments_kernel, ref, (1, 2), timer, repeats, failures, dtype, 0,
        lambda rows: record("segments", rows))
    return out


def best_launches(result: dict) -> dict:
    """{"forward" | "segments": Launch} of the fastest timed candidate of each pass."""
    from memlm.memory.fast.launches import Launch

    best = {}
    for what in ("forward", "segments"):
        timed = [r for r in result.get(what) or [] if "ms" in r]
        if timed:
            best[what] = Launch(*min(timed, key=lambda r: r["ms"])["launch"])
    return best


def config_overrides(result: dict) -> list[str]:
    """The fastest launches of one dtype's sweep as the run's config values
    (memory.triton_forward / memory.triton_backward: LAUNCH_FIELDS in order)."""
    from memlm.memory.fast.launches import LAUNCH_FIELDS

    keys = {"forward": "memory.triton_forward", "segments": "memory.triton_backward"}
    out = []
    for what, launch in best_launches(result).items():
        values = [int(getattr(launch, f) or 0) for f in LAUNCH_FIELDS]  # maxnreg None -> 0, busiest_first -> 0/1
        out.append(f"{keys[what]}=[{','.join(map(str, values))}]")
    return out


def sweep_markdown(result: dict) -> list[str]:
    """One dtype's sweep tables and its fastest launches."""
    lines = []
    dtype = result.get("dtype", "")
    for what, title in (("forward", "forward, Launch(BLOCK_B, BLOCK_K, BLOCK_D, warps, stages, maxnreg, -)"),
                        ("segments", "backward (both gradients, after the sort), Launch(BLOCK_S, BLOCK_K, "
                                     "BLOCK_D, warps, stages, maxnreg, busiest first)")):
        rows = result.get(what) or []
        if not rows:
            continue
        sort = f"; the sort before it takes {result['sort_ms']:.3f} ms" if what == "segments" and result.get(
            "sort_ms") else ""
        lines += ["", f"Sweep of the \"segments\" {title}, {dtype} table{sort}; the first row is the rule's "
                  "default:", "", "| launch | time | effective bandwidth |", "|---|---:|---:|"]
        for r in rows:
            if "same_code_as" in r:
                lines.append(f"| {tuple(r['launch'])} | same code as {tuple(r['same_code_as'])} | - |")
            else:
                lines.append(f"| {tuple(r['launch'])} | {r['ms']:.3f} ms | "
                             + (f"{r['gbs']:.0f} GB/s |" if r.get("gbs") else "- |"))
    best = best_launches(result)
    if best:
        lines += [""] + [f"- Fastest {what} launch, {dtype}: {tuple(launch)} "
                         f"(launches.MEASURED[({what!r}, {launch.block_d}, {result['elem_bytes']})])."
                         for what, launch in best.items()]
        lines += [f"- As the run's config, {dtype} table: `{' '.join(config_overrides(result))}`."]
    return lines


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
