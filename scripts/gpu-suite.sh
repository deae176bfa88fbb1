#!/usr/bin/env bash
# Everything of Djinn that needs a GPU, in one command, on a GPU host with PyTorch installed and
# no Rust (or, for CI, from a normal build on a CPU: the GPU parts are reported as skipped).
#
#   gpu-suite.sh OUT        (from an unpacked bundle of scripts/gpu-bundle.sh)
#
# TORCH_VENV: the venv with torch (default /opt/torch/.venv); the suite runs against its torch,
# which must be the release the bundle was built for. Writes into OUT (a handful of files):
# summary.md (the table printed at the end), gpu-check.txt, tests.log, bench.log and
# bench-results.md (the benchmarks' tables, as bench/RESULTS.md takes them). Bounded to
# SUITE_SECONDS (default 540); exits non-zero when a part failed.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:?usage: gpu-suite.sh OUT}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
TORCH_VENV=${TORCH_VENV:-/opt/torch/.venv}
PY="$TORCH_VENV/bin/python"
DEADLINE=$((SECONDS + ${SUITE_SECONDS:-540}))
SUMMARY="$OUT/summary.md"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/djinn-gpu-suite.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
rm -f "$OUT/bench-results.md"
: >"$OUT/tests.log"
: >"$OUT/bench.log"

# The layout: a bundle (bin/, tests/, torch-version) or, for CI, the repository with a build.
if [ -f "$HERE/torch-version" ]; then
  ROOT=$HERE
  BIN="$HERE/bin/djinn"
  TESTS="$HERE/tests/bin"
  BUILT_FOR=$(cat "$HERE/torch-version")
else
  ROOT=$(cd "$HERE/.." && pwd)
  BIN=${DJINN_BIN:-$ROOT/target/debug/djinn}
  TESTS=""
  BUILT_FOR=""
fi

log() { printf '[gpu-suite] %s\n' "$*" >&2; }
rows=()
failed=0
# row PART STATUS SECONDS FIGURE. A part that failed or was not run counts against the suite.
row() {
  rows+=("| $1 | $2 | $3 | $4 |")
  [[ $2 == failed* || $2 == "not run"* ]] && failed=$((failed + 1))
  log "$1: $2${4:+ ($4)}"
}
# The seconds a part may take: its own cap, or what is left of the suite's.
budget() {
  local left=$((DEADLINE - SECONDS))
  ((left < $1)) && echo "$left" || echo "$1"
}
# step NAME CAP LOG COMMAND...: runs COMMAND bounded, its output appended to LOG; sets $status
# and $took. On failure, the tail of what the step wrote is printed, so CI's log shows it.
step() {
  local name=$1 cap=$2 logfile=$3
  shift 3
  local limit
  limit=$(budget "$cap")
  took=0
  if ((limit <= 0)); then
    status="not run: the suite's time was up"
    return
  fi
  local from
  touch "$logfile"
  from=$(($(wc -l <"$logfile") + 1))
  printf '\n===== %s (at most %s s): %s\n' "$name" "$limit" "$*" >>"$logfile"
  local start=$SECONDS rc=0
  timeout --kill-after=10 "$limit" "$@" >>"$logfile" 2>&1 || rc=$?
  took=$((SECONDS - start))
  case $rc in
    0) status=passed ;;
    124 | 137) status="failed: timed out after ${limit} s" ;;
    *) status="failed (exit $rc, see $(basename "$logfile"))" ;;
  esac
  if ((rc != 0)); then
    log "$name $status; the last lines of its log:"
    tail -n "+$from" "$logfile" | tail -n 40 | sed 's/^/    /' >&2
  fi
}

# --- torch: the host's, and the release this build is for
if ! TORCH_DIR=$("$PY" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null); then
  log "error: no torch in $TORCH_VENV (set TORCH_VENV to the venv with torch)"
  exit 2
fi
TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__)')
if [ -n "$BUILT_FOR" ] && [[ $TORCH_VERSION != "$BUILT_FOR" && $TORCH_VERSION != "$BUILT_FOR".* ]]; then
  log "error: this bundle was built for torch $BUILT_FOR; $TORCH_VENV has torch $TORCH_VERSION"
  log "       build one for it: scripts/gpu-bundle.sh --torch ${TORCH_VERSION%.*}"
  exit 2
fi
export LD_LIBRARY_PATH="$TORCH_DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$ROOT/client-lib/python${PYTHONPATH:+:$PYTHONPATH}"
export DJINN_BIN="$BIN"
log "torch $TORCH_VERSION from $TORCH_DIR; djinn $BIN; results in $OUT"

# --- CUDA discovery, buffers, staging from 1 KiB to 1 GiB, dma-buf export
start=$SECONDS
step "gpu-check" 120 "$OUT/gpu-check.txt" "$BIN" gpu-check --max-size 1GiB
gpu=no
grep -q '^PASS  *CUDA device 0 ' "$OUT/gpu-check.txt" && gpu=yes
[ $gpu = no ] && [ "$status" = passed ] && status="skipped: no CUDA device (the libtorch check passed)"
row "djinn gpu-check: CUDA discovery, device and pinned buffers, staging 1 KiB–1 GiB, dma-buf export" "$status" \
  $((SECONDS - start)) "$(grep -cE '^(PASS|FAIL|UNSUPPORTED)' "$OUT/gpu-check.txt") checks run, $(grep -cE '^(SKIP|NOT RUN)' "$OUT/gpu-check.txt") skipped or not run"
if [ $gpu = yes ]; then
  DEVICE=cuda:0
else
  DEVICE=cpu
  log "no CUDA device: the GPU parts are skipped; the benchmarks run once on the CPU at small sizes, to check the suite itself"
fi
skipped="skipped: no CUDA device"

# --- test models, made here by this torch (an archive from a newer torch may not load)
step "test models" 120 "$OUT/tests.log" "$PY" "$ROOT/tests/models/make_models.py" "$WORK/models"
[ "$status" = passed ] || row "test models (tests/models/make_models.py)" "$status" "$took" ""
export DJINN_TEST_MODELS="$WORK/models"

# --- the Rust tests that need CUDA: the CUDA pieces, then the node's suites on a GPU node (the
# stream bench's own test is left out: the suite runs the bench)
rust_tests() {
  local t
  if [ -n "$TESTS" ]; then
    "$TESTS/gpudirect" --include-ignored || return 1
    "$TESTS/handles" --ignored || return 1
    for t in stream sessions breakpoints; do
      DJINN_TEST_DEVICE=cuda:0 "$TESTS/$t" --test-threads=4 --skip the_stream_bench_runs || return 1
    done
  else
    (cd "$ROOT" && cargo test --locked -p djinn-gpudirect -- --include-ignored && cargo test --locked -p djinn --test handles -- --ignored &&
      DJINN_TEST_DEVICE=cuda:0 cargo test --locked -p djinn --test stream --test sessions --test breakpoints -- --test-threads=4 --skip the_stream_bench_runs)
  fi
}
if [ $gpu = yes ]; then
  step "rust tests" 200 "$OUT/tests.log" bash -c "$(declare -f rust_tests); TESTS='$TESTS' ROOT='$ROOT' rust_tests"
  passed=$(grep -hoE 'test result: ok\. [0-9]+ passed' "$OUT/tests.log" | awk '{s += $4} END {print s + 0}')
  row "Rust tests on a GPU node (gpudirect, handles, stream, sessions, breakpoints)" "$status" "$took" "$passed passed"
elif [ -n "$TESTS" ]; then
  # Not run, but started: each lists its tests, which shows it loads against this torch.
  step "rust test binaries load" 60 "$OUT/tests.log" bash -c 'for t in "$0"/*; do "$t" --list >/dev/null || exit 1; done' "$TESTS"
  [ "$status" = passed ] && status="$skipped (the test binaries load against this torch: ok)"
  row "Rust tests on a GPU node (gpudirect, handles, stream, sessions, breakpoints)" "$status" "$took" ""
else
  row "Rust tests on a GPU node (gpudirect, handles, stream, sessions, breakpoints)" "$skipped" 0 ""
fi

# --- the Python package's GPU tests (pytest reports them skipped without CUDA)
step "pytest" 150 "$OUT/tests.log" "$PY" -m pytest -q -p no:cacheprovider "$ROOT/client-lib/python/tests/test_gpu.py"
figure=$(grep -oE '[0-9]+ (passed|failed|skipped)[^=]*' "$OUT/tests.log" | tail -1)
[ $gpu = no ] && [ "$status" = passed ] && status="$skipped"
row "pytest client-lib/python/tests/test_gpu.py" "$status" "$took" "$figure"

# --- benchmarks: on the GPU at full size; without one, once on the CPU at small sizes
# The headline of a benchmark's output (its lines from FROM on).
headline() {
  local name=$1 from=$2
  tail -n "+$from" "$OUT/bench.log" | case $name in
    stream) grep -E 'of the raw copy|Naive p50 / streamed' ;;
    agents) grep -E 'Largest agent count' ;;
    push) awk -F'|' '/^\| [0-9.]+ [KMG]?i?B \|/ { s = $2; r = $(NF - 1); gsub(/^ +| +$/, "", s); gsub(/^ +| +$/, "", r); printf "%s: %s× the slower leg; ", s, r }' ;;
    resume) grep -E 'resume p50 / plain' ;;
    execute) grep -E 'remote p50 − local p50' ;;
  esac | tr -d '*' | tr '\n' ' ' | sed 's/  */ /g; s/ *$//' | cut -c1-240
}
bench() {
  local name=$1 cap=$2 from
  shift 2
  from=$(($(wc -l <"$OUT/bench.log") + 1))
  step "bench $name" "$cap" "$OUT/bench.log" "$BIN" bench "$name" --results "$OUT/bench-results.md" "$@"
  local what="djinn bench $name --device $DEVICE"
  if [ $gpu = no ] && [ "$status" = passed ]; then
    row "$what" "$skipped (ran on the CPU at small sizes: ok)" "$took" ""
  else
    row "$what" "$status" "$took" "$(headline "$name" "$from")"
  fi
}
if [ $gpu = yes ]; then
  bench stream 60 --device "$DEVICE" --python "$PY"
  bench agents 100 --device "$DEVICE" --python "$PY" --model-script "$ROOT/bench/agents_model.py" \
    --agents 16,64,256 --duration 5 --unloaded-duration 10
  bench push 60 --device "$DEVICE"
  bench resume 40 --device "$DEVICE"
  bench execute 60 --device "$DEVICE" --iters 5000
else
  bench stream 60 --device cpu --python "$PY" --blocks 4 --width 256 --iters 3
  bench agents 90 --device cpu --python "$PY" --model-script "$ROOT/bench/agents_model.py" --context 64 \
    --agents 2 --duration 1 --unloaded-duration 1 --iters 20 --tool-wait-ms 50
  bench push 60 --device cpu --sizes 64KiB,1MiB --volume 16MiB
  bench resume 60 --device cpu --iters 20 --width 128
  bench execute 60 --device cpu --iters 200 --big-iters 2
fi

{
  echo "# gpu-suite: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo "torch $TORCH_VERSION ($TORCH_DIR)${BUILT_FOR:+; bundle built for $BUILT_FOR}; $(uname -srm); $(nproc) cores"
  sed -n 's/^PASS  *CUDA device [0-9]*  *//p' "$OUT/gpu-check.txt" | sed 's/^/GPU: /'
  echo
  echo "| part | result | seconds | figure |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "$failed failed; $((SECONDS)) s in all. Logs: gpu-check.txt, tests.log, bench.log; benchmark tables: bench-results.md."
} >"$SUMMARY"
cat "$SUMMARY"
((failed == 0))
