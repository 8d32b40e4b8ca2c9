"""The planner's output: one plan as text (memory per rank, communication,
step time, the value-table layouts the run could take).

    print(format_plan(plan(cfg, world=64)))
"""

from __future__ import annotations

from typing import Any

from memlm.distributed.value_layout import GPUS, least_traffic
from memlm.plan.cost import HBM_HEADROOM

GiB = 2**30


def gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def size_text(n: float) -> str:
    """`12.34 GiB (13,249,999,872 B)`: readable, and the exact count."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:8.2f} {unit} ({int(n):,} B)"
    return f"{int(n):8d} B"


def format_shape(shape: dict[str, Any]) -> str:
    """`shape: seq_len 8192 x micro_batch 1 per GPU (where each came from)`."""
    origin = shape["from"]
    if origin["seq_len"] == origin["micro_batch"]:
        why = f"both from {origin['seq_len']}"
    else:
        why = f"seq_len from {origin['seq_len']}; micro_batch from {origin['micro_batch']}"
    line = f"shape: seq_len {shape['seq_len']:,} x micro_batch {shape['micro_batch']} per GPU, {why}"
    if shape["train_with"]:
        line += (f"\n  (the trainer's own default is the data config's: train at this shape with "
                 f"{' '.join(shape['train_with'])})")
    return line


def format_plan(p: dict[str, Any]) -> str:
    b, t, c = p["bytes"], p["time"], p["comm_bytes"]
    act = b["activations"]
    lines = [
        f"plan: {p['model']} + {p['memory_kind']} ({p['slots']:,} slots)"
        f"{' + Engram before blocks ' + str(p['engram_layers']) if p.get('engram_layers') else ''}, "
        f"{p['params_total']:,} params "
        f"({p['params_active']:,} active), {p['world']} x {p['gpu']}, memory_parallel {p['memory_parallel']}"
        f"{' (auto)' if p['memory_parallel_setting'] == 'auto' else ''}, "
        f"fsdp {p['fsdp']}, activation_checkpoint {p['activation_checkpoint']}, "
        f"rank {p['rank']}, {p['tokens_per_step']:,} tokens/step",
        format_shape(p["shape"]),
        "per rank, read from the sharded tensors:",
        f"  parameters        {size_text(b['params'])}, value tables {size_text(b['value_tables']).strip()}",
        f"  gradients         {size_text(b['grads'])}",
        f"  optimizer state   {size_text(b['optimizer'])}",
        "per rank, estimated:",
        f"  activations       {size_text(act['saved'] + act['recompute'])}, transient peak "
        f"{size_text(act['transient']).strip()}",
        f"  total             {size_text(b['total'])} of {gib(GPUS[p['gpu']].hbm_bytes)} GiB: "
        f"{'fits' if p['fits'] else 'does NOT fit'} (keeping {1 - HBM_HEADROOM:.0%} free)",
        "communication per optimizer step, sent by one rank:",
        *(f"  {kind:<20}{size_text(v)}" for kind, v in c.items()),
        f"estimated step time on {p['gpu']} (s):",
        f"  compute {t['compute_s']:.4f}, fsdp comm {t['fsdp_comm_s']:.4f} (overlapped with compute), "
        f"memory read {t['memory_read_s']:.4f}, optimizer {t['optimizer_s']:.4f}, memory comm "
        f"{t['memory_comm_s']:.4f}, value reduce {t['value_reduce_s']:.4f}",
        f"  step {t['step_s']:.4f} s, {t['tokens_per_s']:,.0f} tokens/s per GPU, MFU {t['mfu']:.1%}",
        *format_table_traffic(p),
        *format_host_tables(p),
        *format_value_layouts(p),
    ]
    return "\n".join(lines)


def format_table_traffic(p: dict[str, Any]) -> list[str]:
    """The value tables' bytes per optimizer step on this rank (plan/table_traffic.py), [] without them."""
    t = p.get("table_step_bytes") or {}
    if not t:
        return []
    return [
        "value-table traffic per optimizer step on this rank (plan/table_traffic.py):",
        f"  backward adds into the gradient buffer {size_text(t['backward_accumulate']).strip()} (read rows), "
        f"clip norm {size_text(t['clip_norm']).strip()}, AdamW with the clip and the buffer's zeroing "
        f"{size_text(t['optimizer']).strip()}",
    ]


def format_host_tables(p: dict[str, Any]) -> list[str]:
    """Engram's tables in host memory (memory.engram.tables_in=host): what they hold there and the bytes
    a step moves over PCIe; [] with the tables on the device."""
    host = p.get("host_tables") or {}
    if not host.get("bytes"):
        return []
    held, step = host["bytes"], host["step"]
    return [
        f"Engram tables in host memory (memory.engram.tables_in=host): {size_text(sum(held.values())).strip()} "
        "there (tables, their gradients and AdamW moments), not counted above",
        f"  per optimizer step over PCIe: {size_text(step['to_device']).strip()} of rows and read positions to the "
        f"device, {size_text(step['to_host']).strip()} of row ids and row gradients back ({step['rows']:,} rows "
        "expected for reads spread evenly: an upper estimate, text repeats n-grams)",
    ]


VALUE_COLUMNS = ("memory_parallel", "replicas", "memory all-to-all", "value-grad all-reduce",
                 "value-grad touched rows", "comm s")


def format_value_layouts(p: dict[str, Any]) -> list[str]:
    """The value-table layouts the run could take on this world, one row
    each: bytes one rank sends per step and the seconds they add; the
    config's layout and auto's choice marked ([] without value tables or on
    one rank)."""
    layouts = p["value_layouts"]
    if p["world"] == 1 or not layouts:
        return []
    best = least_traffic(layouts)["memory_parallel"]
    used = "touched rows (memory.sparse_updates=true)" if p["memory_sparse_updates"] else "all-reduce"
    rows = [VALUE_COLUMNS]
    for row in layouts:
        marks = [m for m, on in (("this plan", row["memory_parallel"] == p["memory_parallel"]),
                                 ("auto", row["memory_parallel"] == best)) if on]
        rows.append((str(row["memory_parallel"]), str(row["replicas"]), short_bytes(row["memory_all_to_all"]),
                     short_bytes(row["value_grad_all_reduce"]), "~" + short_bytes(row["value_grad_rows"]),
                     f"{row['seconds']:.4f}", *(["<- " + ", ".join(marks)] if marks else [])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(VALUE_COLUMNS))]
    table = ["  " + "  ".join(v.rjust(w) if i < len(widths) else v for i, (v, w) in
                              enumerate(zip(r, [*widths, 0]))).rstrip() for r in rows]
    return [
        f"value-table layouts on {p['world']} ranks, bytes one rank sends per step (touched rows: expected "
        "for reads spread evenly over the table):",
        *table,
        f"  this plan: memory_parallel {p['memory_parallel']}, value gradients by {used}, "
        f"{short_bytes(p['comm_bytes']['value_grad_reduce'])} per step; parallel.memory_parallel=auto (the "
        f"default) takes {best}",
    ]


def short_bytes(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
