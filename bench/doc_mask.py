"""Benchmark: the FlexAttention document-mask builder, eager against compiled (~3 minutes on 2 cores).

    python bench/doc_mask.py              # batch 8, seq 8192; writes its section of docs/benchmarks.md
    python bench/doc_mask.py --batch 2 --seq 2048 --no-write

memlm.model.doc_mask builds one BlockMask per forward from the batch's
document ids. The old builder ran create_block_mask eagerly
(`same_doc_block_mask(doc_ids)`), which evaluates the mask function over the
whole (batch, seq, seq) grid with int64 temporaries of that size; the new
one runs the same function under torch.compile (`block_mask_builder`, on
CUDA). Both run here, in this process, on the same document ids (packed
documents of 64 to 2048 tokens), on this machine's device (CPU unless a GPU
is present); the masks are checked equal first. Reported per builder: the
median time of a build over `--repeats` (the compiled one after its first,
compiling, call, which is reported apart: once per process and shape), and
the peak memory a build adds: resident memory sampled every millisecond by a
thread, above its level at the call (CPU; the allocator's peak on CUDA).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine_line, write_section  # noqa: E402

from memlm.model.doc_mask import _compiled_block_mask, flex_attention, same_doc_block_mask  # noqa: E402

TITLE = "## Document masks (bench/doc_mask.py)"
PAGE = 4096


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakMemory:
    """Peak memory added while the block runs: resident set sampled every
    millisecond on CPU (large tensors are mmapped and given back when freed,
    so the level before the call is the baseline); the CUDA allocator's peak
    on a GPU."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        self.base = rss_bytes()
        self.top = self.base
        self.running = True

        def sample():
            while self.running:
                self.top = max(self.top, rss_bytes())
                time.sleep(0.001)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
            return
        self.top = max(self.top, rss_bytes())
        self.running = False
        self.thread.join()
        self.peak = self.top - self.base


def document_ids(batch: int, seq: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """(batch, seq) int64 ids of packed documents of 64 to 2048 tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < seq:
            lengths.append(int(torch.randint(64, 2049, (1,), generator=gen)))
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:seq])
    return torch.stack(rows).to(device)


def build(builder, doc_ids: torch.Tensor, device: torch.device):
    """One build, timed and measured -> (mask, seconds, peak bytes)."""
    with torch.no_grad(), PeakMemory(device) as mem:
        start = time.perf_counter()
        mask = builder(doc_ids)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return mask, seconds, mem.peak


def same_mask(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.as_tuple(), b.as_tuple()) if torch.is_tensor(x))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3, help="timed builds of each (medians)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    if flex_attention is None:
        print(f"torch {torch.__version__} has no FlexAttention: nothing to measure", file=sys.stderr)
        return 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    header = machine_line()
    print(header)
    doc_ids = document_ids(args.batch, args.seq, device)
    compiled = _compiled_block_mask()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # inductor's notes on CPU
        new_mask, compile_s, compile_peak = build(compiled, doc_ids, device)
    print(f"compiled builder, first call (compiles): {compile_s:.1f} s, peak +{compile_peak / 2**20:.0f} MiB")
    times, peaks = {"eager": [], "compiled": []}, {"eager": [], "compiled": []}
    old_mask = None
    for _ in range(args.repeats):  # interleaved
        for name, builder in (("compiled", compiled), ("eager", same_doc_block_mask)):
            mask, seconds, peak = build(builder, doc_ids, device)
            times[name].append(seconds)
            peaks[name].append(peak)
            if name == "eager":
                old_mask = mask
            del mask
        print({name: f"{t[-1]:.3f} s, +{peaks[name][-1] / 2**20:.0f} MiB" for name, t in times.items()})
    if not same_mask(old_mask, new_mask):
        print("FAIL: the compiled builder's mask differs from the eager one", file=sys.stderr)
        return 1
    t = {name: statistics.median(v) for name, v in times.items()}
    m = {name: max(v) for name, v in peaks.items()}
    blocks = new_mask.kv_num_blocks.sum().item() + (new_mask.full_kv_num_blocks.sum().item()
                                                   if new_mask.full_kv_num_blocks is not None else 0)
    # Below 1 MiB the sampled resident set cannot tell (pages the allocator already holds).
    floor = 2**20
    new_peak = f"{m['compiled'] / 2**20:.0f} MiB" if m["compiled"] >= floor else "< 1 MiB"
    less = f"{m['eager'] / m['compiled']:.0f}x" if m["compiled"] >= floor else f"> {m['eager'] / floor:.0f}x"
    lines = [
        "| builder | time per build | peak memory added | first call |",
        "|---|---:|---:|---|",
        f"| eager `create_block_mask` (before) | {t['eager']:.2f} s | {m['eager'] / 2**30:.2f} GiB | |",
        f"| compiled (after) | {t['compiled'] * 1e3:.0f} ms | {new_peak} | compiles: {compile_s:.0f} s, "
        f"+{compile_peak / 2**20:.0f} MiB |",
        f"| eager / compiled | {t['eager'] / t['compiled']:.0f}x the time | {less} the memory | |",
    ]
    body = "\n".join([
        header, "",
        f"The FlexAttention block mask of packed rows (memlm.model.doc_mask), batch {args.batch}, seq "
        f"{args.seq:,} (up to {doc_ids.max().item() + 1} documents a row, {blocks:,} non-empty 128 x 128 "
        f"blocks), on {device.type.upper()}: create_block_mask run eagerly (the builder before) and compiled "
        f"(`block_mask_builder` on CUDA), same process, same ids, masks checked equal. Medians of "
        f"{args.repeats} interleaved builds; peak memory a build adds above its start (resident set "
        "sampled every 1 ms on CPU; the CUDA allocator's peak on a GPU).", "",
        *lines, "",
        "- The eager builder evaluates the mask function over the whole (batch, seq, seq) grid: each "
        "`doc_ids[b, q]` gather is an int64 tensor of that size before the comparison reduces it to a "
        "bool mask, which is then reduced to blocks. Compiled, each block is reduced as it is computed.",
        "- The compiled builder compiles once per (batch, seq) shape and process (a training run has one "
        "shape). memlm uses it on CUDA, where FlexAttention trains; on CPU it keeps the eager builder: flex "
        "there is the eager reference path without a backward, which materializes the (batch, heads, seq, "
        "seq) scores itself, and the tests' short rows would each pay the compile.",
        "- A few MiB is the resolution of the resident-set sampler (pages the allocator already holds "
        "do not show). The first call's compile time is lower when inductor's on-disk cache holds the "
        "builder from an earlier run in the same temporary directory.",
    ])
    print(body)
    if not args.no_write:
        write_section(TITLE, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
