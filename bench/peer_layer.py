"""Benchmark: PEER's down projection through memlm.memory.fast.row_dots vs a gather (CPU, ~1 minute).

    python bench/peer_layer.py

PEER computes act(u_i . x) for the H*knn experts each token retrieved. The
baseline gathers the u rows into a (T, H*knn, dim) tensor and multiplies
(F.embedding + bmm, what autograd then differentiates); memlm's layer takes
the dot products in slot order without the gather (memory/fast/row_dots.py). Both
run the same PEER layer (same retrieval, same up projection), forward +
backward, one step each in turn in this process; median times and their
ratio go to docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import machine_line, write_section  # noqa: E402

from memlm.model.peer import ACTIVATIONS, PEER  # noqa: E402

TITLE = "## PEER layer (bench/peer_layer.py)"
# (tokens, dim, heads, knn, n_keys): the ablation's PEER, and a wider one.
SHAPES = [(4096, 64, 4, 16, 128), (2048, 256, 8, 16, 256)]


def gather_forward(layer: PEER, x: torch.Tensor) -> torch.Tensor:
    """The same layer with the (T, H*knn, dim) gather of the u rows."""
    weights, idx = layer.retrieve(x)
    idx = idx.flatten(1)
    u = F.embedding(idx, layer.experts.down)
    hidden = ACTIVATIONS[layer.activation](torch.bmm(u, x.unsqueeze(-1)).squeeze(-1))
    return F.embedding_bag(idx, layer.experts.up, per_sample_weights=weights.flatten(1) * hidden, mode="sum")


def main() -> int:
    torch.manual_seed(0)
    rows = []
    for tokens, dim, heads, knn, n_keys in SHAPES:
        layer = PEER(dim, n_keys, heads, knn, k_dim=64)
        layer.init_weights(0.02, 0.02)
        x = torch.randn(tokens, dim, requires_grad=True)
        torch.testing.assert_close(layer(x), gather_forward(layer, x), atol=1e-5, rtol=1e-5)
        steps = {"row_dots": lambda layer=layer, x=x: layer(x).sum().backward(),
                 "gather": lambda layer=layer, x=x: gather_forward(layer, x).sum().backward()}
        times = {k: [] for k in steps}
        for _ in range(2):
            for f in steps.values():
                f()
        for _ in range(9):
            for k, f in steps.items():
                start = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - start)
        med = {k: 1000 * statistics.median(v) for k, v in times.items()}
        rows.append(f"| {tokens:,} | {dim} | {heads} x {knn} | {n_keys**2:,} | {med['gather']:.1f} ms "
                    f"| {med['row_dots']:.1f} ms | {med['gather'] / med['row_dots']:.2f}x |")
        print(rows[-1], flush=True)
    body = "\n".join([
        machine_line() + f" {torch.get_num_threads()} torch thread(s); median of 9 interleaved steps.", "",
        "PEER layer forward + backward, the u . x of the retrieved experts as a gather + bmm "
        "vs memlm.memory.fast.row_dots "
        "(same layer otherwise; outputs checked equal first).", "",
        "| tokens | dim | heads x knn | experts | gather + bmm | row_dots | speedup |",
        "|---:|---:|---|---:|---:|---:|---:|", *rows])
    write_section(TITLE, body)
    print(f"[bench] wrote {TITLE!r} to docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
