"""How the Triton read (memory/fast/triton_bag.py) launches: one `Launch` per pass.

    launches = read_launches("segments", forward=[1, 16, 4, 1, 128, 0], backward=[])  # memory.triton_*, checked
    launch = forward_launch(v_dim, reads, bags, dtype, launches.forward)  # the forward's Launch
    launch = segments_launch(v_dim, dtype, launches.backward)             # the backward's ("segments" walk)

A pass's launch is, first to last: the model's config (memory.triton_forward /
memory.triton_backward: a `ReadLaunches` the memory layers hold and pass to
every read, like memory.kernel; () keeps the next), a launch measured on a
GPU (MEASURED), or a rule derived from the hardware's shape (16-byte vector
loads, one warp per 32 lanes), not from a measurement. The CUDA defaults are
settled by a device run (bench/gpu_speed.py sweeps the candidates and prints
MEASURED's entries). A config list holds LAUNCH_FIELDS in order; BLOCK_D is
always the rule's (whole rows up to MAX_BLOCK_D).

No triton import here: memory/config.py validates the config with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

# The Triton read's algorithms (memory.triton_algorithm). The first kernels
# ("by_slot", "atomic") are kept for comparison only, in bench/bag_variants.py.
ALGORITHMS = ("segments",)
DEFAULT_ALGORITHM = "segments"
# Widest column block of one program (whole rows up to this v_dim).
MAX_BLOCK_D = 2048
# What a config list (memory.triton_forward / triton_backward) sets, in order.
LAUNCH_FIELDS = ("block_b", "block_k", "num_warps", "num_stages", "maxnreg", "busiest_first")
WARPS = (1, 2, 4, 8, 16, 32)
MAXNREG = (16, 255)  # Triton's maxnreg range on NVIDIA GPUs (0 in a config list: the compiler's choice)


class Launch(NamedTuple):
    """One kernel launch's blocks and Triton options."""

    block_b: int  # forward: bags per program; backward: segments per program (BLOCK_S)
    block_k: int  # rows gathered per step
    block_d: int  # columns per program (power of two)
    num_warps: int
    num_stages: int
    maxnreg: int | None = None  # registers per thread (Triton's maxnreg); None: the compiler's choice
    # Backward only: programs take the segments longest first, one of the longest per
    # program (a stable argsort of the segment lengths first); else in slot order.
    busiest_first: bool = False


# Launches measured on a GPU, keyed (pass, BLOCK_D, table element bytes), pass
# "forward" or "segments". Empty: no GPU has measured them yet (bench/gpu_speed.py).
MEASURED: dict[tuple[str, int, int], Launch] = {}


class ReadLaunches(NamedTuple):
    """A model's config lists (memory.triton_forward, memory.triton_backward),
    each () or LAUNCH_FIELDS in order: what its reads pass to the read op."""

    forward: tuple[int, ...] = ()
    backward: tuple[int, ...] = ()


NO_LAUNCHES = ReadLaunches()


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def launch_problem(values: list[int]) -> str | None:
    """What is wrong with a config launch list (memory.triton_forward / triton_backward), or None."""
    values = list(values)
    if not values:
        return None
    if len(values) != len(LAUNCH_FIELDS) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                     for v in values):
        return f"[] or {len(LAUNCH_FIELDS)} integers: {', '.join(LAUNCH_FIELDS)}"
    block_b, block_k, warps, stages, maxnreg, busiest = values
    if not (_pow2(block_b) and _pow2(block_k)):
        return "block_b and block_k powers of two"
    if warps not in WARPS:
        return f"num_warps one of {', '.join(map(str, WARPS))}"
    if stages < 1:
        return "num_stages >= 1"
    if maxnreg and not MAXNREG[0] <= maxnreg <= MAXNREG[1]:
        return f"maxnreg 0 (the compiler's choice) or in [{MAXNREG[0]}, {MAXNREG[1]}]"
    if busiest not in (0, 1):
        return "busiest_first 0 or 1"
    return None


def read_launches(algorithm: str, forward: list[int], backward: list[int]) -> ReadLaunches:
    """A model's settings (memory.triton_algorithm, triton_forward, triton_backward),
    checked; a ValueError names what is invalid."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"triton_algorithm={algorithm!r} is invalid: one of {', '.join(ALGORITHMS)}")
    for key, values in (("triton_forward", forward), ("triton_backward", backward)):
        problem = launch_problem(values)
        if problem:
            raise ValueError(f"{key}={list(values)!r} is invalid: {problem}")
    return ReadLaunches(tuple(forward), tuple(backward))


def _chosen(what: str, rule: Launch, elem_bytes: int, values: Sequence[int]) -> Launch:
    if values:
        fields = dict(zip(LAUNCH_FIELDS, values))
        fields["maxnreg"] = fields["maxnreg"] or None
        fields["busiest_first"] = bool(fields["busiest_first"])
        return rule._replace(**fields)
    return MEASURED.get((what, rule.block_d, elem_bytes), rule)


def block_d(v_dim: int) -> int:
    return min(next_pow2(v_dim), MAX_BLOCK_D)


def _pow2_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _warps(block_d: int, elem_bytes: int) -> int:
    """One lane per 16-byte vector of a row; a warp per 32 lanes, 1 to 8."""
    lanes = max(1, block_d * elem_bytes // 16)
    return max(1, min(8, lanes // 32))


def forward_launch(v_dim: int, reads: int, bags: int, dtype: torch.dtype, configured: Sequence[int] = ()) -> Launch:
    """The forward's launch (module docstring; `configured`: memory.triton_forward). The rule: whole rows, a warp per
    32 16-byte lanes, several bags per program when a row leaves lanes idle, and
    ~16 KB of rows gathered per step."""
    size = torch.empty((), dtype=dtype).element_size()
    bd = block_d(v_dim)
    warps = _warps(bd, size)
    lanes = max(1, bd * size // 16)
    bb = min(max(1, 32 * warps // lanes), next_pow2(bags))
    bk = _pow2_at_most(max(1, min(16, 16384 // (bb * bd * size))))
    return _chosen("forward", Launch(bb, min(bk, next_pow2(reads)), bd, warps, 1), size, configured)


def segments_launch(v_dim: int, dtype: torch.dtype, configured: Sequence[int] = ()) -> Launch:
    """The backward's launch (module docstring; `configured`: memory.triton_backward). The rule: whole rows, 8
    segments per program, 4 reads a step (a segment holds B*K/N reads on
    average: ~2 at the paper's shape)."""
    size = torch.empty((), dtype=dtype).element_size()
    bd = block_d(v_dim)
    return _chosen("segments", Launch(8, 4, bd, _warps(bd, size), 1), size, configured)
