"""Transparent huge pages for large tables read at random rows (CPU, Linux).

A memory layer reads a few hundred thousand random rows of its value table
per step. With 4 KB pages every row of a large table (2 GB at 1M slots x 512
floats) lies on a page whose address translation is not cached, so each read
also walks the page table; with 2 MB pages the translations of the whole
table fit in the TLB, which speeds up the forward read of a large table on
CPU (bench/memory_layer.py measures the layer; figures in docs/benchmarks.md).

Linux backs memory with huge pages when asked to with madvise(MADV_HUGEPAGE)
(the system default "madvise" mode of transparent huge pages does nothing
otherwise). The advice only changes how the kernel backs pages touched after
it, so `advise_huge_pages` must run before the table is first written (the
layers call it right before initializing it). Best effort: on other systems,
other devices, small or non-plain tensors it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

import torch

MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
HUGE_PAGE = 2 << 20
MIN_BYTES = 64 << 20  # smaller tables stay in cache anyway


@functools.lru_cache(maxsize=1)
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(tensor: torch.Tensor, min_bytes: int = MIN_BYTES) -> bool:
    """Ask the kernel to back `tensor`'s storage with huge pages (the whole
    2 MB pages inside it). Returns whether the advice was given."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type != "cpu":
        return False  # DTensor, meta, CUDA...: nothing to do here
    madvise = _madvise()
    storage = tensor.untyped_storage()
    if madvise is None or storage.nbytes() < min_bytes:
        return False
    begin = -(-storage.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # round up: stay inside the storage
    end = (storage.data_ptr() + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
    return end > begin and madvise(begin, end - begin, MADV_HUGEPAGE) == 0
