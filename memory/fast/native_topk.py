"""Top-k of many short CPU rows through a small C kernel (memory/fast/topk_rows.c).

Product-key search spends most of its CPU time in top-k over short rows
(the n_keys sub-key scores of every token, head and half, then ~knn*ln(knn)
candidate sums): torch.topk takes ~2 us per 128-element row. The C kernel
sorts many rows at once through one sorting network, one row per SIMD lane,
faster at those shapes (bench/topk.py; figures in docs/benchmarks.md).

The results are torch.topk's, indices included, ties included: which of
equal values torch.topk keeps, and in which order, is where its C++
selection leaves them (std::partial_sort, or std::nth_element then
std::sort; not the lower index first), so the kernel flags every row whose
top k touches a tie (two equal values among the k, or the k-th equal to one
left out; -0.0 equals 0.0 and NaN equals NaN, as in torch.topk), and those
rows are answered by torch.topk itself. They are rare among float scores:
22 of 1.3M rows in 200 steps of the demo.

The kernel is compiled on first use with the system C compiler (`$CC`, else
`cc`) for this CPU (-march=native) into a cache keyed by the source, the
compiler and the CPU (`$MEMLM_CACHE_DIR`, else `~/.cache/memlm`), about a
second, once per machine. Without a compiler, or with MEMLM_NATIVE_TOPK=0,
`topk` is torch.topk (a warning says why, once). Float32 CPU rows with a
power-of-two k <= 128 use the kernel; anything else goes to torch.topk.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from pathlib import Path

import torch

from memlm.files import atomic_output

SOURCE = Path(__file__).with_name("topk_rows.c")
ENABLE_ENV = "MEMLM_NATIVE_TOPK"
CACHE_ENV = "MEMLM_CACHE_DIR"
MAX_K = 128  # topk_rows.c: MAX_K
# Tried in order. -fopenmp: rows split over torch's own OpenMP threads (see
# topk_rows.c); without it (e.g. a compiler without OpenMP) one thread.
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O3"])


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's feature flags (Linux), else its name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "memlm"
    )
    return Path(root) / "native"


def _compile(compiler: str) -> Path:
    """Build (or find in the cache) the shared library; raises RuntimeError."""
    source = SOURCE.read_bytes()
    errors = []
    for flags in FLAG_SETS:
        key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(flags).encode(),
                                         platform.machine().encode(), _cpu_signature().encode()]))
        target = _cache_dir() / f"topk_rows-{key.hexdigest()[:16]}.so"
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build under a private name and rename: ranks that start together
        # each build their own copy and never load a half-written file.
        try:
            with atomic_output(target, suffix=".so", durable=False) as tmp:  # a cache: rebuilt if lost
                cmd = [compiler, *flags, "-shared", "-fPIC", str(SOURCE), "-o", str(tmp)]
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                if out.returncode != 0:
                    raise _BuildFailed(out.stderr.strip()[-500:])
            return target
        except (OSError, subprocess.TimeoutExpired, _BuildFailed) as e:
            errors.append(f"{' '.join(cmd)}: {e}")
    raise RuntimeError("; ".join(errors))


class _BuildFailed(Exception):
    """The compiler ran and refused these flags (its stderr is the message)."""


@functools.lru_cache(maxsize=1)
def _library():
    """The loaded kernel, or None (and a warning, once) when it cannot be had."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    try:
        if compiler is None:
            raise RuntimeError("no C compiler found (set CC)")
        lib = ctypes.CDLL(str(_compile(compiler)))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"memlm: the native top-k kernel is unavailable, using torch.topk "
                      f"(product-key search is slower on CPU): {e}", RuntimeWarning, stacklevel=3)
        return None
    fn = lib.memlm_topk_rows
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int64
    return fn


def available() -> bool:
    """Whether `topk` can use the C kernel on this machine."""
    return _library() is not None


def _supported(x: torch.Tensor, k: int) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() >= 1 and x.numel() > 0
            and 1 <= k <= MAX_K and k & (k - 1) == 0 and k <= x.shape[-1] < 2**31
            and x.stride(-1) == 1 and type(x) in (torch.Tensor, torch.nn.Parameter))


def _row_offsets(x: torch.Tensor) -> torch.Tensor:
    """(rows,) int64: where each row of x (any strides over the leading dims) starts, in elements."""
    offsets = torch.zeros((), dtype=torch.long)
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.long) * stride
    return offsets.reshape(-1).contiguous()


def _redo_with_torch(x: torch.Tensor, offsets: torch.Tensor, tied: torch.Tensor, k: int,
                     values: torch.Tensor, indices: torch.Tensor) -> None:
    """Overwrite rows `tied` (bool, (rows,)) of values / indices (rows, k) with
    torch.topk of those rows of x, read through their offsets (no copy of x)."""
    rows = tied.nonzero().squeeze(1)  # (t,)
    n = x.shape[-1]
    storage = x.detach().as_strided((int(offsets.max()) + n,), (1,))  # x's elements from its first
    picked = storage[offsets[rows].unsqueeze(1) + torch.arange(n)]  # (t, n)
    ref_values, ref_indices = picked.topk(k, dim=-1)
    values[rows], indices[rows] = ref_values, ref_indices


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k, dim=-1) (sorted, largest first): the same values and
    indices, through the C kernel when it applies (rows whose top k touches a
    tie through torch.topk). Values keep autograd (gathered from x) when x needs it."""
    fn = _library() if _supported(x, k) else None
    if fn is None:
        return x.topk(k, dim=-1)
    lead, n = x.shape[:-1], x.shape[-1]
    offsets = _row_offsets(x)
    rows = offsets.numel()
    values = torch.empty(rows, k, dtype=x.dtype)
    indices = torch.empty(rows, k, dtype=torch.long)
    tied = torch.empty(rows, dtype=torch.bool)
    n_tied = fn(x.data_ptr(), offsets.data_ptr(), rows, n, k, values.data_ptr(), indices.data_ptr(),
                tied.data_ptr(), torch.get_num_threads())
    if n_tied < 0:
        raise RuntimeError(f"memlm_topk_rows rejected n={n}, k={k}")  # _supported should have caught it
    if n_tied:
        _redo_with_torch(x, offsets, tied, k, values, indices)
    values, indices = values.view(*lead, k), indices.view(*lead, k)
    if torch.is_grad_enabled() and x.requires_grad:
        values = x.gather(-1, indices)
    return values, indices
