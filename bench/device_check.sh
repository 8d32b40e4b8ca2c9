#!/usr/bin/env bash
# Device check for a lent GPU machine (one H200; more GPUs where available).
# One short run measures, one section at a time, each under its own timeout
# (a failed or timed-out section is recorded and the next one runs):
#   env          GPU, driver, torch/triton versions, GPU count
#   kernel_tests tests/test_kernels*.py + row_dots with CUDA: compiled Triton, no interpreter
#   kernel_bench bench/kernels.py --gpu-only: Triton vs F.embedding_bag bandwidth at the paper's shapes
#   mfu          bf16 MFU of the 373M dense and Memory+ models (the real Trainer, random tokens)
#   compile      step-time speedup of parallel.compile=true over eager, both models
#   nosync       torch.cuda.set_sync_debug_mode("error") around every non-logging step (Memory+, MoE)
#   equivalence  2 NCCL ranks (memory_parallel=2) == 1 process; only with >= 2 GPUs
# Everything goes under $OUT: one log per section, JSON figures, a copy of
# docs/benchmarks.md with the GPU kernel rows, and summary.txt (one line per
# section: status, seconds, result). Budget: the limits below add up to
# 440 s on one GPU, and a section that would pass $BUDGET_S (450 s) is
# shortened or skipped, so the run ends within 8 minutes on one H200.
# No installs: it runs the machine's python3 with its torch and triton;
# memlm is imported from this checkout. The training sections need
# hydra-core, omegaconf and torchdata, which the H200 image lacks: run
# `bash bench/device_wheels.sh` here first and carry ".whl" (installed
# offline into a temporary folder).
#
#   OUT=/tmp/out bash bench/device_check.sh
#   DRY_RUN=1 OUT=/tmp/out bash bench/device_check.sh   # tiny versions on CPU: checks the plumbing
#   SECTIONS="mfu nosync" OUT=/tmp/out bash bench/device_check.sh
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$(mktemp -d)}"  # the device tool provides $OUT
PY="${PYTHON:-python3}"
DRY_RUN="${DRY_RUN:-0}"
SECTIONS="${SECTIONS:-env kernel_tests kernel_bench mfu compile nosync equivalence}"
BUDGET_S="${BUDGET_S:-450}"
mkdir -p "$OUT"
cd "$REPO_ROOT"

# The repository root *is* the package memlm: expose it under that name
# through a symlink instead of `pip install -e` (no network there).
PKG_DIR="$(mktemp -d)"
trap 'rm -rf "$PKG_DIR"' EXIT
ln -s "$REPO_ROOT" "$PKG_DIR/memlm"
# Wheels fetched by bench/device_wheels.sh (hydra-core, omegaconf, ...: the
# training path needs them, the machine's image lacks them) go to a
# temporary site folder, without network.
if [ -d "$REPO_ROOT/.whl" ] && [ "${DRY_RUN:-0}" != "1" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$PKG_DIR/site" "$REPO_ROOT"/.whl/*.whl >"$OUT/wheels.log" 2>&1 \
        || echo "installing .whl/ failed: see $OUT/wheels.log"
fi
export PYTHONPATH="$PKG_DIR:$PKG_DIR/site${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export PYTHONUNBUFFERED=1  # a section killed by its timeout still leaves its log
unset TRITON_INTERPRET  # compiled kernels only

DRY_FLAG=()
SCALE=1
if [ "$DRY_RUN" = "1" ]; then
    DRY_FLAG=(--dry-run)
    SCALE=4          # CPU is slower: longer limits, and no 8-minute budget
    BUDGET_S=100000
fi

SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
start=$SECONDS
failures=0

wanted() { [[ " $SECTIONS " == *" $1 "* ]]; }

# run_section NAME LIMIT_S CMD...: run CMD with its output in $OUT/NAME.log,
# killed after LIMIT_S x SCALE seconds (or what is left of the budget), and
# append one line to the summary: status, seconds, the RESULT line (or the
# last PARTIAL line, or the last line of the log).
run_section() {
    local name=$1 limit=$(($2 * SCALE))
    shift 2
    local used=$((SECONDS - start))
    if ((used + limit > BUDGET_S)); then
        limit=$((BUDGET_S - used))
        if ((limit < 20)); then
            printf '%-13s %-20s %5s  %s\n' "$name" "SKIPPED" "0s" "budget: ${used}s of ${BUDGET_S}s used" | tee -a "$SUMMARY"
            return
        fi
    fi
    echo "== $name (limit ${limit}s, log $OUT/$name.log)"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$? status=ok
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status="TIMEOUT (${limit}s)"
    elif [ "$rc" -ne 0 ]; then
        status="FAIL (exit $rc)"
    fi
    [ "$status" = ok ] || failures=$((failures + 1))
    local detail
    detail="$(grep -hE '^(RESULT|PARTIAL) ' "$OUT/$name.log" | tail -n 1)"
    [ -n "$detail" ] || detail="$(tail -n 1 "$OUT/$name.log")"
    printf '%-13s %-20s %5s  %s\n' "$name" "$status" "$((SECONDS - t0))s" "$detail" | tee -a "$SUMMARY"
}

env_report() {
    echo "date: $(date -u +%FT%TZ)"
    echo "dry run: $DRY_RUN"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi failed"
    "$PY" -c "import torch, memlm; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(), '| gpus', torch.cuda.device_count(), '| memlm from', memlm.__path__[0])"
    "$PY" -c "import triton; print('triton', triton.__version__)" || echo "triton: not importable"
    for mod in hydra omegaconf torchdata numpy sentencepiece; do
        "$PY" -c "import $mod" 2>/dev/null && echo "$mod: ok" || echo "$mod: MISSING (bench/device_wheels.sh)"
    done
    echo "RESULT env ok: $("$PY" -c 'import torch; print(torch.cuda.device_count(), "GPU(s)")' 2>&1 | tail -n 1)"
}

if wanted env; then
    export -f env_report
    export PY DRY_RUN
    run_section env 15 bash -c env_report
    cat "$OUT/env.log"
fi

if wanted kernel_tests; then
    if [ "$DRY_RUN" = "1" ]; then  # the CUDA-only kernel tests: collected and skipped on CPU
        run_section kernel_tests 60 "$PY" -m pytest tests/test_kernels_cuda.py -q -rs -p no:cacheprovider \
            --junitxml="$OUT/kernel_tests.xml"
    else
        run_section kernel_tests 90 "$PY" -m pytest tests/test_kernels*.py tests/test_memory_row_dots.py \
            -q -rs -p no:cacheprovider --junitxml="$OUT/kernel_tests.xml"
    fi
fi

if wanted kernel_bench; then
    cp docs/benchmarks.md "$OUT/benchmarks.md"  # the new GPU part is written into this copy
    if [ "$DRY_RUN" = "1" ]; then
        run_section kernel_bench 60 "$PY" bench/kernels.py --quick --no-sweep --json "$OUT/kernels.json" \
            --doc "$OUT/benchmarks.md"
    else
        run_section kernel_bench 80 "$PY" bench/kernels.py --gpu-only --no-sweep --json "$OUT/kernels_gpu.json" \
            --doc "$OUT/benchmarks.md"
    fi
fi

# The training sections: bench/device_train.py prints the RESULT line.
wanted mfu && run_section mfu 90 "$PY" bench/device_train.py mfu ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} --json "$OUT/mfu.json"
wanted compile && run_section compile 120 "$PY" bench/device_train.py compile ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} --json "$OUT/compile.json"
wanted nosync && run_section nosync 45 "$PY" bench/device_train.py nosync ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} --json "$OUT/nosync.json"
if wanted equivalence; then
    gpus="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
    if [ "$DRY_RUN" = "1" ] || [ "${gpus:-0}" -ge 2 ]; then
        run_section equivalence 60 "$PY" bench/device_train.py equivalence ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} --json "$OUT/equivalence.json"
    else
        printf '%-13s %-20s %5s  %s\n' equivalence SKIPPED 0s "needs 2 GPUs, found ${gpus:-0}" | tee -a "$SUMMARY"
    fi
fi

{
    echo "failed sections: $failures"
    echo "wall: $((SECONDS - start)) s"
} | tee -a "$SUMMARY"
[ "$failures" -eq 0 ]
