#!/usr/bin/env bash
# Every test: installs what is missing, then each step below. `.ci/run` calls this on a fresh
# machine. Every step runs, whatever the ones before it did, each under a timeout, its duration
# and result printed as it ends and again in a table at the end; the script exits non-zero if
# any step failed.
#
#   scripts/test.sh              every step
#   scripts/test.sh --self-test  checks this runner: the step list run with a failure injected
#                                into the first step and a hang into the second (each step's
#                                command replaced), every later step must still run, the hang
#                                must be cut by its timeout, and the run must exit non-zero
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# --- the runner ---------------------------------------------------------------------------------
# TEST_SH_DRY=FILE: each step records its name in FILE and runs a stand-in instead of its
# command: the first fails, the second hangs (cut by a 2 s timeout), the rest pass.
DRY=${TEST_SH_DRY:-}
results=()
failed=0
index=0

# step NAME TIMEOUT_SECONDS FUNCTION: runs FUNCTION (defined below, exported) in its own process
# group under TIMEOUT_SECONDS, its output streamed; records the result.
step() {
  local name=$1 limit=$2 fn=$3 rc=0 start=$SECONDS result
  index=$((index + 1))
  printf '\n== [%d] %s (at most %d s)\n' "$index" "$name" "$limit" >&2
  if [ -n "$DRY" ]; then
    echo "$name" >>"$DRY"
    case $index in
      1) timeout "$limit" false || rc=$? ;;
      2) timeout 2 sleep 60 || rc=$? ;;
      *) timeout "$limit" true || rc=$? ;;
    esac
  else
    # timeout runs the step in a process group of its own and signals all of it.
    timeout --kill-after=30 "$limit" bash -c "$fn" || rc=$?
  fi
  local took=$((SECONDS - start)) free
  free=$(free_gib)
  case $rc in
    0) result=passed ;;
    124 | 137) result="FAILED: timed out" ;;
    *) result="FAILED (exit $rc)" ;;
  esac
  [ $rc -eq 0 ] || failed=$((failed + 1))
  printf '== [%d] %s: %s in %d s (%s GiB free after it)\n' "$index" "$name" "$result" "$took" "$free" >&2
  results+=("| $index | $name | $result | $took | $free |")
}

# The disk left where the build goes: a full disk fails steps in ways that look like bugs.
free_gib() { df -Pk "$ROOT" | awk 'NR == 2 { printf "%.1f", $4 / 1048576 }'; }

summary() {
  {
    printf '\n== scripts/test.sh: %d of %d steps failed, %d s in all\n\n' "$failed" "$index" "$SECONDS"
    echo "| # | step | result | seconds | GiB free after |"
    echo "|---|---|---|---|---|"
    printf '%s\n' "${results[@]}"
  } >&2
}

if [ "${1:-}" = "--self-test" ]; then
  record=$(mktemp)
  trap 'rm -f "$record"' EXIT
  rc=0
  TEST_SH_DRY=$record bash "$0" >/dev/null 2>"$record.log" || rc=$?
  steps=$(grep -c '^step ' "$0" | tr -d ' ')
  ran=$(wc -l <"$record" | tr -d ' ')
  fails=0
  check() { if eval "$1"; then echo "ok: $2"; else echo "FAILED: $2"; fails=$((fails + 1)); fi; }
  check '[ "$rc" -ne 0 ]' "a run whose first step failed exits non-zero (exit $rc)"
  check '[ "$ran" -eq "$steps" ] && [ "$steps" -gt 2 ]' "every step ran after the first failed ($ran of the $steps steps)"
  check 'grep -q "^== \[1\] .*: FAILED (exit 1)" "$record.log"' "the failed step is reported as failed"
  check 'grep -q "^== \[2\] .*: FAILED: timed out" "$record.log"' "a hung step is cut by its timeout and reported"
  check 'grep -q "^== scripts/test.sh: 2 of $steps steps failed" "$record.log"' "the summary counts both"
  check 'grep -qE "^\| $steps \| .* \| passed \| [0-9]+ \| [0-9.]+ \|$" "$record.log"' "the last step ran and passed, with its duration and the disk left"
  rm -f "$record.log"
  ((fails == 0)) || exit 1
  echo "scripts/test.sh --self-test: the runner runs every step, times out a hang and fails the run"
  exit 0
fi

# --- the steps ----------------------------------------------------------------------------------
# Each is a function run by `bash -c`, so it is exported with the variables it uses.
export ROOT
export CARGO_TERM_COLOR=never
# Each build here is made once: no incremental state (gigabytes), and line tables only for
# debug info (a panic's backtrace keeps its files and lines): target/debug is 3 GiB, not 8.
export CARGO_INCREMENTAL=0
export CARGO_PROFILE_DEV_DEBUG=line-tables-only
printf '== %s GiB free at the start\n' "$(free_gib)" >&2

setup() { bash scripts/setup.sh --no-build; }

runner_self_test() { bash scripts/test.sh --self-test; }

lint() {
  set -e
  cargo fmt --all --check
  python3 scripts/import-cycles.py
  python3 scripts/test-lint.py
  # The wire protocol stays free of I/O and device crates: the fuzz targets and anything that
  # only speaks the protocol build without them.
  local io_crates poller_crates
  io_crates=$(cargo tree -p djinn-proto -e normal --prefix none --locked | grep -E '^(mio|io-uring|sideway|rdma-mummy-sys|cudarc|tokio|libloading) ' || true)
  [ -z "$io_crates" ] || { printf 'djinn-proto depends on I/O or device crates:\n%s\n' "$io_crates" >&2; exit 1; }
  # The executor speaks to the transports only through the node's core: no poller, no sockets
  # of its own. The core needs neither I/O nor libtorch.
  io_crates=$(cargo tree -p djinn-executor -e normal --prefix none --locked | grep -E '^(mio|io-uring|djinn-dataplane|sideway|tokio) ' || true)
  [ -z "$io_crates" ] || { printf 'djinn-executor depends on the transports:\n%s\n' "$io_crates" >&2; exit 1; }
  io_crates=$(cargo tree -p djinn-node-core -e normal --prefix none --locked | grep -E '^(mio|io-uring|djinn-dataplane|sideway|rdma-mummy-sys|tokio|tch|torch-sys|cudarc) ' || true)
  [ -z "$io_crates" ] || { printf 'djinn-node-core depends on I/O or libtorch:\n%s\n' "$io_crates" >&2; exit 1; }
  # The Python package's extension builds the transports without the node's poller.
  poller_crates=$(cargo tree -p djinn-python -e normal --prefix none --locked | grep -E '^(mio|io-uring|cudarc) ' || true)
  [ -z "$poller_crates" ] || { printf 'the Python extension depends on the node poller or CUDA:\n%s\n' "$poller_crates" >&2; exit 1; }
}

clippy() {
  set -e
  cargo clippy --workspace --all-targets --locked -- -D warnings
  # The data plane alone, as the Python extension builds it (without the node's poller).
  cargo clippy -p djinn-dataplane --all-targets --locked -- -D warnings
}

# The build GPU hosts run (scripts/gpu-bundle.sh: torch 2.11, tch 0.24), checked by clippy
# against torch 2.11's headers. A check links nothing, so the headers come from torch's own
# wheel (0.5 GB, 25 s to fetch and unpack here; none of its CUDA wheels) rather than a whole
# venv (2.6 GB of wheels, a minute more to install); the bundle itself links against a venv.
torch_2_11() {
  set -e
  local dir=target/torch-2.11-headers
  local version=$dir/include/torch/headeronly/version.h
  if [ ! -f "$version" ]; then
    rm -rf "$dir" "$dir.tmp" target/torch-2.11-wheel
    .venv/bin/pip download -q --disable-pip-version-check --no-cache-dir --no-deps --only-binary=:all: \
      -d target/torch-2.11-wheel torch==2.11.0
    .venv/bin/python - target/torch-2.11-wheel/torch-2.11.0-*.whl "$dir" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    wheel.extractall(sys.argv[2] + ".tmp", [n for n in wheel.namelist() if n.startswith("torch/include/")])
PY
    mv "$dir.tmp/torch" "$dir" && rmdir "$dir.tmp"
    rm -rf target/torch-2.11-wheel
  fi
  grep -q '^#define TORCH_VERSION_MINOR 11$' "$version"
  local features=djinn/torch-2-11,djinn-executor/torch-2-11,djinn-node/torch-2-11,djinn-bench/torch-2-11
  LIBTORCH=$PWD/$dir cargo clippy --locked -p djinn -p djinn-executor -p djinn-node -p djinn-bench \
    --no-default-features --features "$features" --all-targets -- -D warnings
}

# The fuzz crate, on nightly as cargo-fuzz builds it (its own lock file and target directory);
# on stable, saying so, where the machine has no nightly toolchain (the crate builds on both).
fuzz_crate() {
  local toolchain=+nightly
  rustup toolchain list 2>/dev/null | grep -q '^nightly' ||
    { toolchain=""; echo "no nightly toolchain here: checking the fuzz crate on stable" >&2; }
  cargo $toolchain check --locked --manifest-path fuzz/Cargo.toml --bins
}

cargo_tests() { cargo test --workspace --locked --no-fail-fast; }

doc_blocks() { python3 scripts/doc-blocks.py "$ROOT/target/debug"; }

python_tests() {
  DJINN_BIN="$ROOT/target/debug/djinn" .venv/bin/python -m pytest -q -rs --timeout=300 client-lib/python/tests
}

# No GPU here: its GPU parts are reported skipped.
gpu_suite_on_cpu() {
  TORCH_VENV="$ROOT/.venv" DJINN_BIN="$ROOT/target/debug/djinn" scripts/gpu-suite.sh target/gpu-suite
}

# The README's first command, as a newcomer runs it (it checks its own results).
demo() { bash scripts/demo.sh; }

rdma_in_vm() {
  set -e
  # Python is slow to start under emulation: the models the tests register are made here.
  local models="$ROOT/target/test-models" rdma_tests
  .venv/bin/python tests/models/make_models.py "$models" >/dev/null 2>&1
  rdma_tests=$(cargo test -p djinn --test rdma --no-run --locked --message-format=json 2>/dev/null |
    .venv/bin/python -c 'import json, sys
found = [m["executable"] for m in map(json.loads, sys.stdin)
         if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "rdma" and m.get("executable")]
print(found[-1])')
  # The tests that need a device are ignored on the host; in the VM, they all run.
  DJINN_TEST_MODELS="$models" scripts/softroce-vm.sh -- "$rdma_tests" --include-ignored --test-threads=1
}

export -f setup runner_self_test lint clippy torch_2_11 fuzz_crate cargo_tests doc_blocks python_tests \
  gpu_suite_on_cpu demo rdma_in_vm

# A step's timeout is several times its usual duration on the CI machine (printed by each run).
step "set-up (scripts/setup.sh --no-build)" 2400 setup
step "this runner's self-test (scripts/test.sh --self-test)" 120 runner_self_test
step "rustfmt, import cycles, test lint, the protocol crate's dependencies" 600 lint
step "clippy (warnings are errors)" 1800 clippy
step "the GPU hosts' build: clippy with torch 2.11 (tch 0.24)" 1800 torch_2_11
step "the fuzz crate builds (nightly)" 900 fuzz_crate
step "cargo test --workspace" 2400 cargo_tests
step "the docs' runnable blocks" 900 doc_blocks
step "python tests (the real extension against a real node)" 1800 python_tests
step "the GPU suite on this build (no GPU here: its GPU parts are reported skipped)" 900 gpu_suite_on_cpu
step "the demo (scripts/demo.sh, as the README runs it)" 1800 demo
step "RDMA tests in the soft-RoCE VM (qemu, TCG: minutes)" 1800 rdma_in_vm

summary
((failed == 0))
