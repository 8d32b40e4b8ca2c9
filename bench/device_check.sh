#!/usr/bin/env bash
# Device check for the Triton read kernels, for a lent GPU machine (H200):
#   1. tests/test_kernels*.py with CUDA: the compiled kernels, no interpreter;
#   2. bench/kernels.py --gpu-only: Triton vs F.embedding_bag at the paper's
#      shapes plus a block-size sweep.
# Everything it writes goes under $OUT (7 files). Budget: under 8 minutes in
# all (each step has its own timeout). No installs: it runs on the machine's
# python3 with its torch and triton; memlm is imported from this checkout.
#
#   OUT=/tmp/out bash bench/device_check.sh
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$(mktemp -d)}"  # the device tool provides $OUT
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
cd "$REPO_ROOT"

# The repository root *is* the package memlm: expose it under that name
# through a symlink instead of `pip install -e` (no network there).
PKG_DIR="$(mktemp -d)"
trap 'rm -rf "$PKG_DIR"' EXIT
ln -s "$REPO_ROOT" "$PKG_DIR/memlm"
export PYTHONPATH="$PKG_DIR${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled kernels only

start=$SECONDS
{
    echo "date: $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi failed"
    "$PY" -c "import torch, triton, memlm; print('torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.cuda.is_available(), '| memlm from', memlm.__path__[0])"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== kernel tests (log: $OUT/kernel_tests.log)"
timeout 240 "$PY" -m pytest tests/test_kernels*.py tests/test_memory_row_dots.py \
    -q -rs -p no:cacheprovider --junitxml="$OUT/kernel_tests.xml" >"$OUT/kernel_tests.log" 2>&1
tests_rc=$?
tail -n 15 "$OUT/kernel_tests.log"

echo "== GPU benchmark (log: $OUT/bench_gpu.log)"
cp docs/benchmarks.md "$OUT/benchmarks.md"  # the new GPU part is written into this copy
timeout 200 "$PY" bench/kernels.py --gpu-only --json "$OUT/kernels_gpu.json" --doc "$OUT/benchmarks.md" \
    >"$OUT/bench_gpu.log" 2>&1
bench_rc=$?
cat "$OUT/bench_gpu.log"

{
    echo "kernel tests: exit $tests_rc ($(tail -n 1 "$OUT/kernel_tests.log"))"
    echo "benchmark: exit $bench_rc"
    echo "wall: $((SECONDS - start)) s"
} | tee "$OUT/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
