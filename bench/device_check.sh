#!/usr/bin/env bash
# Device check for a lent GPU machine (one H200; more GPUs where available).
# One short run checks, one section at a time, each under its own timeout;
# a failed or timed-out section is recorded and the next one runs. A section
# passes only when its command exits 0 and prints `RESULT <section> ok`;
# otherwise its summary line reads FAIL (or TIMEOUT) with the reason, and
# the script exits non-zero. What each section proves, and its rule:
#   env             the GPU, driver, torch/triton and the training modules are there.
#                   FAIL: torch or triton not importable, or no CUDA GPU. hydra, omegaconf or
#                   torchdata missing (bench/device_wheels.sh) is reported; the sections needing them SKIP.
#   kernel_tests    tests/unit/test_kernels*.py + row_dots run on CUDA: compiled Triton, no interpreter.
#                   FAIL: a test fails or errors, no test ran, or a CUDA test was skipped.
#   kernel_bench    bench/kernels.py --gpu-only: each kernel (Triton by slot and atomic, our
#                   torch path, F.embedding_bag) at the paper's shape is checked, then timed.
#                   FAIL: a kernel raises, or its output, table or weight gradient is off the
#                   float32 reference by more than 2e-2 of its max (bf16).
#   mfu             bf16 MFU of the 373M dense and Memory+ models (the real Trainer, random tokens).
#                   FAIL: a model's MFU under MFU_FLOOR (default 10% of the dense bf16 peak,
#                   bench/device_train.py says why), a non-finite loss, or no known peak.
#   nosync          every non-logging step of `fit` (Memory+ and MoE, 134M base) watched.
#                   FAIL: a host read of a CUDA tensor (.item(), .tolist(), bool(), ...) in such
#                   a step, or a sync under torch.cuda.set_sync_debug_mode("error") (3rd step on).
#   compile_dense   parallel.compile=true against eager, 134M dense (cold compile included).
#   compile_memplus the same with Memory+ (its own limit: the memory block compiles too).
#                   FAIL: a graph break, more graphs than one per distinct block (recompiles:
#                   dense 1, Memory+ 2), or a speedup (eager / compiled step time) <= 1.
#   paths           bench/device_train.py paths (bench/device_paths.py): the CUDA branches
#                   the sections above never take, a few real steps each on the random-facts
#                   corpus: document masks (FlexAttention), memory.kernel=torch, sparse value
#                   updates, PEER, Engram with its tables on the device and in host memory, a
#                   checkpoint with slot usage, the facts eval, finetune=sparse
#                   from it, generation from it.
#                   FAIL: a path raises or ends on a non-finite loss.
#   equivalence     2 NCCL ranks (memory_parallel=2) == 1 process; only with >= 2 GPUs.
#                   FAIL: a loss or weight more than 1e-3 off.
#   speed_kernels   bench/gpu_speed.py kernels (issue #49): at the paper's read, fp32 then bf16 tables,
#                   our "segments" kernels (dense, accumulated into a gradient buffer, sparse), the first
#                   kernels (bench/bag_variants.py), the torch path, F.embedding_bag and the official kernel
#                   (.official/, from bench/official_kernel.sh), checked then timed fwd, bwd, fwd+bwd; a copy
#                   baseline, an L2-resident table and a hot-slot case beside them.
#                   FAIL: one of ours raises or is off the float32 reference (1e-4 fp32, 2e-2 bf16, of its
#                   max), or .official/ is missing (a dry run only notes it).
#   speed_sweep     bench/gpu_speed.py sweep: the "segments" launches at both dtypes (maxnreg and 1-warp
#                   backward programs included; a candidate compiling to an earlier one's code is not timed).
#                   FAIL: a candidate raises or is off the reference.
#   speed_train     bench/gpu_speed.py train --mode eager: 373M dense, Memory+ with an fp32 and with a bf16
#                   table, on the sweep's fastest launches; tokens/s, MFU, peak memory (reset per model).
#                   FAIL: a run raises or ends on a non-finite loss.
#   speed_profile   bench/gpu_speed.py profile: one Memory+ (fp32 table) and one dense step under
#                   torch.profiler, device time counted once, split (search, read fwd/bwd, table gradient
#                   sum, clipping, optimizer, the rest); raw per-op and per-kernel tables in its JSON.
#                   FAIL: a step raises or no device time was recorded.
#   speed_compiled  bench/gpu_speed.py train --mode compiled: the same three models, parallel.compile=true.
#                   FAIL: as speed_train.
# SECTIONS="... compile ..." runs both compile sections; SECTIONS="... speed ..." the five speed sections
# (issue #49's run: SECTIONS="env speed", limits 30 + 150 + 75 + 80 + 60 + 140 s, the budget below cuts
# the last). Everything goes under $OUT: one log per section, JSON figures (written
# after each row: a section cut by its limit keeps what finished), a copy of docs/benchmarks.md
# with the GPU rows, wheels.log, and summary.txt (one line per section: status,
# seconds, result). A section that would pass $BUDGET_S (480 s, counted from the
# start, wheel installs included) is shortened or skipped, so the run ends within
# 8 minutes; each limit includes that section's cold start (CUDA context, Triton
# and inductor compilation).
# No network: it runs the machine's python3 with its torch and triton
# (written for torch >= 2.11 and triton >= 3.6; env prints both);
# memlm is imported from this checkout. The training sections need
# hydra-core, omegaconf and torchdata, which the GPU images lack: run
# `bash bench/device_wheels.sh` here first and carry ".whl". The script prints the
# machine's Python version and installs the wheels one at a time into a
# temporary folder (WHEELS=DIR: another folder), each said installed or refused
# (a cp312 wheel on another Python). A section that needs a module still missing
# is SKIPPED, its summary line naming the modules; the exit status is then 3
# (0: every section ran and passed; 1: a section failed).
#
#   OUT=/tmp/out bash bench/device_check.sh
#   DRY_RUN=1 OUT=/tmp/out bash bench/device_check.sh   # tiny versions on CPU: checks the plumbing
#   SECTIONS="mfu nosync" OUT=/tmp/out bash bench/device_check.sh
#   MFU_FLOOR=0.2 OUT=/tmp/out bash bench/device_check.sh  # another MFU floor (a fraction)
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$(mktemp -d)}"  # the device tool provides $OUT
PY="${PYTHON:-python3}"
DRY_RUN="${DRY_RUN:-0}"
SECTIONS="${SECTIONS:-env kernel_tests kernel_bench mfu nosync compile_dense compile_memplus paths equivalence}"
SECTIONS=" ${SECTIONS} "
SECTIONS="${SECTIONS// compile / compile_dense compile_memplus }"
SECTIONS="${SECTIONS// speed / speed_kernels speed_sweep speed_train speed_profile speed_compiled }"
BUDGET_S="${BUDGET_S:-480}"
mkdir -p "$OUT"
cd "$REPO_ROOT"

start=$SECONDS
# The repository root *is* the package memlm: expose it under that name
# through a symlink instead of `pip install -e` (no network there).
PKG_DIR="$(mktemp -d)"
trap 'rm -rf "$PKG_DIR"' EXIT
ln -s "$REPO_ROOT" "$PKG_DIR/memlm"
export PYTHONPATH="$PKG_DIR:$PKG_DIR/site${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export PYTHONUNBUFFERED=1  # a section killed by its timeout still leaves its log
unset TRITON_INTERPRET  # compiled kernels only

# Wheels fetched by bench/device_wheels.sh (hydra-core, omegaconf, torchdata, ...:
# the training path needs them, the machine's image lacks them), one at a
# time into a temporary site folder, without network; each said installed or refused.
WHEELS="${WHEELS:-$REPO_ROOT/.whl}"
PYVER="$("$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null || echo "unknown (no $PY)")"
echo "python: $PY, Python $PYVER" | tee "$OUT/wheels.log"
refused=()
# install_wheel WHL: pip into the site folder; without pip, a pure-Python wheel
# is unpacked there (a wheel is a zip of the installed files). Prints pip's error.
HOW="pip"
"$PY" -m pip --version >/dev/null 2>&1 || HOW="unpacked: $PY has no pip"
install_wheel() {
    if [ "$HOW" = pip ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$PKG_DIR/site" "$1" 2>&1
    elif [[ "$1" == *-none-any.whl ]]; then
        "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$1" "$PKG_DIR/site" 2>&1
    else
        echo "ERROR: no pip for $PY, and not a pure-Python wheel"
        return 1
    fi
}
if [ -d "$WHEELS" ]; then
    for whl in "$WHEELS"/*.whl; do
        [ -e "$whl" ] || continue
        if pip_out="$(install_wheel "$whl")"; then
            echo "wheel installed ($HOW): $(basename "$whl")" | tee -a "$OUT/wheels.log"
        else
            refused+=("$(basename "$whl")")
            echo "wheel REFUSED on Python $PYVER: $(basename "$whl"): $(grep -m 1 ERROR <<<"$pip_out" || tail -n 1 <<<"$pip_out")" \
                | tee -a "$OUT/wheels.log"
        fi
    done
else
    echo "no wheel folder $WHEELS (bench/device_wheels.sh makes .whl/)" | tee -a "$OUT/wheels.log"
fi
# The training modules still missing after the installs: the sections that need them are skipped
# (a Python that does not run at all is no reason to skip: its sections run and fail, each named).
TRAIN_MISSING=()
if [[ "$PYVER" != unknown* ]]; then
    for mod in hydra omegaconf torchdata; do
        "$PY" -c "import $mod" 2>/dev/null || TRAIN_MISSING+=("$mod")
    done
fi
TRAIN_WHY=""
if [ "${#TRAIN_MISSING[@]}" -gt 0 ]; then
    TRAIN_WHY="needs ${TRAIN_MISSING[*]}: not importable on Python $PYVER"
    [ "${#refused[@]}" -gt 0 ] && TRAIN_WHY+="; wheels refused: ${refused[*]}"
    [ -d "$WHEELS" ] || TRAIN_WHY+="; no wheel folder (bench/device_wheels.sh, carry .whl)"
    echo "training modules missing: ${TRAIN_MISSING[*]} -> the training sections are skipped" | tee -a "$OUT/wheels.log"
fi

DRY_FLAG=()
SCALE=1
if [ "$DRY_RUN" = "1" ]; then
    DRY_FLAG=(--dry-run)
    SCALE=4          # CPU is slower: longer limits, and no 8-minute budget
    BUDGET_S=100000
fi

SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
failures=0
skipped=()

wanted() { [[ " $SECTIONS " == *" $1 "* ]]; }

# trains NAME: whether section NAME (wanted) can import the training modules;
# if not, its SKIPPED line says which are missing and why.
trains() {
    [ -z "$TRAIN_WHY" ] && return 0
    skipped+=("$1")
    printf '%-15s %-20s %5s  %s\n' "$1" "SKIPPED" "0s" "$TRAIN_WHY" | tee -a "$SUMMARY"
    return 1
}

# run_section NAME LIMIT_S CMD...: run CMD with its output in $OUT/NAME.log,
# killed after LIMIT_S x SCALE seconds (or what is left of the budget), and
# append one line to the summary: status, seconds, the RESULT line (or the
# last PARTIAL line, or the last line of the log). ok only when CMD exits 0
# and the log has a `RESULT NAME ok` line.
run_section() {
    local name=$1 limit=$(($2 * SCALE))
    shift 2
    local used=$((SECONDS - start))
    if ((used + limit > BUDGET_S)); then
        limit=$((BUDGET_S - used))
        if ((limit < 20)); then
            printf '%-15s %-20s %5s  %s\n' "$name" "SKIPPED" "0s" "budget: ${used}s of ${BUDGET_S}s used" | tee -a "$SUMMARY"
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
    elif ! grep -qE "^RESULT $name ok" "$OUT/$name.log"; then
        status="FAIL (no RESULT ok)"
    fi
    [ "$status" = ok ] || failures=$((failures + 1))
    local detail
    detail="$(grep -hE '^(RESULT|PARTIAL) ' "$OUT/$name.log" | tail -n 1)"
    [ -n "$detail" ] || detail="$(tail -n 1 "$OUT/$name.log")"
    printf '%-15s %-20s %5s  %s\n' "$name" "$status" "$((SECONDS - t0))s" "$detail" | tee -a "$SUMMARY"
}

# env_report: versions and modules; exit 1 when something the other
# sections need is missing (torch, triton, a CUDA GPU, the training modules).
env_report() {
    local missing=() absent=()
    echo "date: $(date -u +%FT%TZ)"
    echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)' 2>&1)"
    echo "dry run: $DRY_RUN"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi failed"
    "$PY" -c "import torch, memlm; print('torch', torch.__version__, '| cuda', torch.cuda.is_available(), '| gpus', torch.cuda.device_count(), '| memlm from', memlm.__path__[0])" \
        || missing+=("torch/memlm")
    "$PY" -c "import triton; print('triton', triton.__version__)" || { echo "triton: not importable"; [ "$DRY_RUN" = "1" ] || missing+=(triton); }
    for mod in hydra omegaconf torchdata numpy sentencepiece; do
        if where="$("$PY" -c "import $mod; print($mod.__file__)" 2>/dev/null)"; then
            echo "$mod: ok ($where)"
        else
            echo "$mod: MISSING (bench/device_wheels.sh)"
            case $mod in hydra|omegaconf|torchdata) absent+=("$mod") ;; esac
        fi
    done
    local gpus
    gpus="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null | tail -n 1)"
    if [ "$DRY_RUN" != "1" ] && [ "${gpus:-0}" -lt 1 ] 2>/dev/null; then
        missing+=("a CUDA GPU")
    fi
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "RESULT env FAIL: missing ${missing[*]}"
        return 1
    fi
    local note=""
    [ "${#absent[@]}" -gt 0 ] && note="; training modules missing: ${absent[*]} (the sections that need them are skipped)"
    echo "RESULT env ok: ${gpus:-0} GPU(s)$note"
}

# kernel_tests_run PYTEST_ARGS...: pytest with a junit report, then one
# RESULT line judged from the report (judge_junit).
kernel_tests_run() {
    "$PY" -m pytest "$@" -q -rs -p no:cacheprovider --junitxml="$OUT/kernel_tests.xml"
    local rc=$?
    judge_junit "$OUT/kernel_tests.xml" "$rc"
}

# judge_junit XML PYTEST_RC: FAIL on a failed or erroring test, a non-zero
# pytest exit, no test run, or (not in a dry run) a skipped CUDA test.
judge_junit() {
    "$PY" - "$1" "$2" "$DRY_RUN" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

path, rc, dry = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
try:
    cases = list(ET.parse(path).getroot().iter("testcase"))
except (OSError, ET.ParseError) as err:
    print(f"RESULT kernel_tests FAIL: no junit report (pytest exit {rc}): {err}")
    sys.exit(1)
name = lambda c: f"{c.get('classname')}::{c.get('name')}"
failed = [name(c) for c in cases if c.find("failure") is not None or c.find("error") is not None]
skipped = [c for c in cases if c.find("skipped") is not None]
cuda_skipped = [name(c) for c in skipped if "test_kernels_cuda" in (c.get("classname") or "")]
ran = len(cases) - len(skipped)
reasons = []
if failed:
    reasons.append(f"{len(failed)} failed: " + ", ".join(failed[:3]))
if rc != 0 and not failed:
    reasons.append(f"pytest exit {rc}")
if ran == 0:
    reasons.append("no test ran")
if cuda_skipped and not dry:
    reasons.append(f"{len(cuda_skipped)} CUDA test(s) skipped on a GPU machine: " + ", ".join(cuda_skipped[:2]))
if reasons:
    print("RESULT kernel_tests FAIL: " + "; ".join(reasons))
    sys.exit(1)
print(f"RESULT kernel_tests ok: {ran} passed, {len(skipped)} skipped" + (" (dry run: CUDA tests skip on CPU)" if dry else ""))
PYEOF
}

if wanted env; then
    export -f env_report
    export PY DRY_RUN
    # 30 s: on a fresh H200 the three cold torch imports took 16 s.
    run_section env 30 bash -c env_report
    cat "$OUT/env.log"
fi

if wanted kernel_tests; then
    export -f kernel_tests_run judge_junit
    export PY OUT DRY_RUN
    if [ "$DRY_RUN" = "1" ]; then  # the CUDA-only kernel tests are collected and skip on CPU; the CPU ops run
        run_section kernel_tests 60 bash -c 'kernel_tests_run "$@"' _ tests/unit/test_kernels_cuda.py tests/unit/test_kernels_ops.py
    else
        run_section kernel_tests 75 bash -c 'kernel_tests_run "$@"' _ tests/unit/test_kernels*.py tests/unit/test_memory_row_dots.py
    fi
fi

if wanted kernel_bench; then
    cp docs/benchmarks.md "$OUT/benchmarks.md"  # the new GPU part is written into this copy
    if [ "$DRY_RUN" = "1" ]; then
        run_section kernel_bench 60 "$PY" bench/kernels.py --quick --no-sweep --json "$OUT/kernels.json" \
            --doc "$OUT/benchmarks.md"
    else
        run_section kernel_bench 40 "$PY" bench/kernels.py --gpu-only --no-sweep --json "$OUT/kernels_gpu.json" \
            --doc "$OUT/benchmarks.md"
    fi
fi

# The training sections: bench/device_train.py prints the RESULT line.
TRAIN=("$PY" bench/device_train.py)
MFU_FLAG=()
[ -n "${MFU_FLOOR:-}" ] && MFU_FLAG=(--mfu-floor "$MFU_FLOOR")
wanted mfu && trains mfu && run_section mfu 70 "${TRAIN[@]}" mfu ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} \
    ${MFU_FLAG[@]+"${MFU_FLAG[@]}"} --json "$OUT/mfu.json"
wanted nosync && trains nosync && run_section nosync 45 "${TRAIN[@]}" nosync ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} \
    --json "$OUT/nosync.json"
for variant in dense memplus; do
    limit=70
    [ "$variant" = memplus ] && limit=110
    wanted "compile_$variant" && trains "compile_$variant" && run_section "compile_$variant" "$limit" \
        "${TRAIN[@]}" compile --variant "$variant" ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} --json "$OUT/compile_$variant.json"
done
wanted paths && trains paths && run_section paths 120 "${TRAIN[@]}" paths ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} \
    --json "$OUT/paths.json"
# Issue #49's speed run (bench/gpu_speed.py), the decisive parts first. The
# kernels and the sweep run under the interpreter in a dry run; the official
# kernel comes from .official/ (carried); the training parts run on the
# sweep's fastest launches (whatever its JSON holds when they start).
SPEED=("$PY" bench/gpu_speed.py)
KERNEL_ENV=()
[ "$DRY_RUN" = "1" ] && KERNEL_ENV=(env TRITON_INTERPRET=1)
OFFICIAL=()
[ -d "$REPO_ROOT/.official" ] && OFFICIAL=(--official "$REPO_ROOT/.official")
SPEED_OUT=(--doc "$OUT/benchmarks.md")
if [[ "$SECTIONS" == *" speed_"* ]]; then
    [ -f "$OUT/benchmarks.md" ] || cp docs/benchmarks.md "$OUT/benchmarks.md"  # the new rows go into this copy
fi
wanted speed_kernels && run_section speed_kernels 150 ${KERNEL_ENV[@]+"${KERNEL_ENV[@]}"} "${SPEED[@]}" kernels \
    ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} ${OFFICIAL[@]+"${OFFICIAL[@]}"} --json "$OUT/speed_kernels.json" "${SPEED_OUT[@]}"
wanted speed_sweep && run_section speed_sweep 75 ${KERNEL_ENV[@]+"${KERNEL_ENV[@]}"} "${SPEED[@]}" sweep \
    ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} --json "$OUT/speed_sweep.json" "${SPEED_OUT[@]}"
wanted speed_train && trains speed_train && run_section speed_train 80 "${SPEED[@]}" train --mode eager \
    ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} --sweep "$OUT/speed_sweep.json" --json "$OUT/speed_train.json" "${SPEED_OUT[@]}"
wanted speed_profile && trains speed_profile && run_section speed_profile 60 "${SPEED[@]}" profile \
    ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} --sweep "$OUT/speed_sweep.json" --json "$OUT/speed_profile.json" "${SPEED_OUT[@]}"
wanted speed_compiled && trains speed_compiled && run_section speed_compiled 140 "${SPEED[@]}" train --mode compiled \
    ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} --sweep "$OUT/speed_sweep.json" --json "$OUT/speed_train.json" "${SPEED_OUT[@]}"
if wanted equivalence && trains equivalence; then
    gpus="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
    if [ "$DRY_RUN" = "1" ] || [ "${gpus:-0}" -ge 2 ]; then
        run_section equivalence 60 "${TRAIN[@]}" equivalence ${DRY_FLAG[@]+"${DRY_FLAG[@]}"} --json "$OUT/equivalence.json"
    else
        printf '%-15s %-20s %5s  %s\n' equivalence SKIPPED 0s "needs 2 GPUs, found ${gpus:-0}" | tee -a "$SUMMARY"
    fi
fi

{
    echo "failed sections: $failures"
    [ "${#skipped[@]}" -gt 0 ] && echo "skipped sections: ${#skipped[@]}: ${skipped[*]} ($TRAIN_WHY)"
    echo "wall: $((SECONDS - start)) s"
} | tee -a "$SUMMARY"
if [ "$failures" -gt 0 ]; then
    exit 1
fi
[ "${#skipped[@]}" -eq 0 ] || exit 3
