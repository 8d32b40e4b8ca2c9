"""One training step's device time split by part (bench/gpu_speed.py profile).

    parts, ops = split_device_time(prof.events(), table_shapes={(1048576, 1024)})
    # parts: {part: ms, ..., "the rest": ms, "total": ms}; ops: the raw per-op table

Device time is counted once. A profiler's event list holds each kernel
twice: as a device event (its duration) and inside the self device time of
the CPU op that launched it (`self_device_time_total` of a CPU event is the
time of the kernels it launched itself, not its children's). The total is
the sum of the device events; a part is the sum of the self device times of
the CPU ops assigned to it; "the rest" is the total less the parts (kernels
of unassigned ops, and any kernel the profiler could not link to an op), so
the shares add up to 100%.

A CPU op with device time goes to the first part that claims it, looking at
the op and its CPU ancestors (innermost first):
1. clipping / norm: a gradient norm or the clip's scaling (CLIP_OPS, by
   exact name: the model's RMSNorm is pow/mean/rsqrt, never these);
2. the outermost memlm custom op in the chain (MEMLM_OPS: search, read
   forward and backward, the exact fp32 projections, the table's AdamW);
3. optimizer step: inside `Optimizer.step#...` or `Optimizer.zero_grad#...`
   (torch.optim's own profiler ranges);
4. table gradient sum / zeroing: an op that takes a tensor of the value
   table's shape and was claimed by none of the above (autograd's sum of the
   layers' dense table gradients, zeroing a gradient buffer);
5. the backward node of a memlm custom op
   (`autograd::engine::evaluate_function: GeneratedBackwardFor_memlm_<op>...`):
   that op's backward part.
Everything else is "the rest" (attention, matmuls, the loss, ...).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch.autograd import DeviceType

TABLE_SUM = "table gradient sum / zeroing"
CLIP = "clipping / norm"
OPTIMIZER = "optimizer step"
REST = "the rest"
CLIP_OPS = frozenset({"aten::_foreach_norm", "aten::linalg_vector_norm", "aten::norm", "aten::_foreach_mul_"})
# memlm custom op (torch.ops.memlm.<name>) -> its part.
MEMLM_OPS = {
    "product_key_search": "search forward", "product_key_ranks": "search forward",
    "exact_subkey_scores": "search forward", "product_key_search_backward": "search backward",
    "embedding_bag": "read forward", "embedding_bag_into": "read forward",
    "embedding_bag_backward": "read backward", "embedding_bag_accumulate_": "read backward",
    "exact_linear": "exact fp32 projections",
    "table_adamw_": OPTIMIZER,  # the table's AdamW step, the clip coefficient folded in (memory/fast/table_step.py)
}
# The backward node of a custom op: its forward's part -> the backward part.
BACKWARD_OF = {"search forward": "search backward", "read forward": "read backward",
               "exact fp32 projections": "exact fp32 projections"}
PARTS = ("search forward", "search backward", "read forward", "read backward", "exact fp32 projections",
         TABLE_SUM, CLIP, OPTIMIZER)
BACKWARD_NODE = "autograd::engine::evaluate_function: GeneratedBackwardFor_memlm_"


def _chain(event) -> list:
    """The event and its CPU ancestors, innermost first."""
    out = []
    while event is not None:
        out.append(event)
        event = event.cpu_parent
    return out


def _memlm_part(name: str) -> str | None:
    return MEMLM_OPS.get(name[len("memlm::"):]) if name.startswith("memlm::") else None


def _backward_node_part(name: str) -> str | None:
    if not name.startswith(BACKWARD_NODE):
        return None
    op = name[len(BACKWARD_NODE):]
    # Longest op name first: "embedding_bag_into_default..." is not "embedding_bag".
    for key in sorted(MEMLM_OPS, key=len, reverse=True):
        if op.startswith(key + "_default"):
            return BACKWARD_OF.get(MEMLM_OPS[key], MEMLM_OPS[key])
    return None


def _takes_table(event, table_shapes: set[tuple[int, ...]]) -> bool:
    return any(tuple(shape) in table_shapes for shape in (getattr(event, "input_shapes", None) or []))


def part_of(event, table_shapes: set[tuple[int, ...]]) -> str:
    """The part a CPU op's own device time belongs to (the module docstring's rules)."""
    chain = _chain(event)
    if any(e.name in CLIP_OPS for e in chain):
        return CLIP
    memlm = [part for e in chain if (part := _memlm_part(e.name))]
    if memlm:
        return memlm[-1]  # the outermost
    if any(e.name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")) for e in chain):
        return OPTIMIZER
    if table_shapes and any(_takes_table(e, table_shapes) for e in chain):
        return TABLE_SUM
    for e in chain:
        part = _backward_node_part(e.name)
        if part:
            return part
    return REST


def split_device_time(events: Iterable, table_shapes: set[tuple[int, ...]],
                      device: bool = True) -> tuple[dict, dict]:
    """({part: ms, "the rest": ms, "total": ms}, {op name: {"part", "ms", "calls"}}) from
    a profiler's FunctionEvents; each kernel counted once (module docstring).
    device=False (a CPU-only profile): the CPU ops' self CPU time instead,
    the total their sum."""
    parts = {part: 0.0 for part in PARTS}
    ops: dict[str, dict] = {}
    total = 0.0
    for e in events:
        if getattr(e, "is_async", False):
            continue
        if e.device_type != DeviceType.CPU:
            if device:
                total += e.self_device_time_total / 1e3  # a kernel, memcpy or memset: its duration, once
            continue
        ms = (e.self_device_time_total if device else e.self_cpu_time_total) / 1e3
        if not device:
            total += ms
        if ms <= 0:
            continue
        part = part_of(e, table_shapes)
        if part != REST:
            parts[part] += ms
        key = f"{e.name} [{part}]"
        row = ops.setdefault(key, {"op": e.name, "part": part, "ms": 0.0, "calls": 0})
        row["ms"] += ms
        row["calls"] += 1
    named = sum(parts.values())
    parts[REST] = max(0.0, total - named)
    parts["total"] = max(total, named)
    return parts, dict(sorted(ops.items(), key=lambda kv: -kv[1]["ms"]))


def kernel_table(events: Iterable) -> list[dict]:
    """Device events by name: [{"kernel", "ms", "calls"}], the longest first."""
    rows: dict[str, dict] = {}
    for e in events:
        if e.device_type == DeviceType.CPU or getattr(e, "is_async", False):
            continue
        row = rows.setdefault(e.name, {"kernel": e.name[:160], "ms": 0.0, "calls": 0})
        row["ms"] += e.self_device_time_total / 1e3
        row["calls"] += 1
    return sorted(rows.values(), key=lambda r: -r["ms"])


def shares(parts: dict) -> dict:
    """{part: fraction of the total} (the rest included; they add up to 1)."""
    total = parts["total"]
    return {k: (v / total if total else 0.0) for k, v in parts.items() if k != "total"}
