#!/usr/bin/env bash
# Every test: installs what is missing, then clippy (warnings are errors), the Rust tests
# (unit, property and integration tests against real node processes), and the Python tests
# once the Python package has them. `.ci/run` calls this on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --no-build

step() { printf '\n== %s\n' "$*" >&2; }

step "rustfmt, clippy, import cycles, the protocol crate's dependencies"
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
python3 scripts/import-cycles.py
# The wire protocol stays free of I/O and device crates: the fuzz targets and anything that
# only speaks the protocol build without them.
io_crates=$(cargo tree -p djinn-proto -e normal --prefix none --locked | grep -E '^(mio|io-uring|sideway|rdma-mummy-sys|cudarc|tokio|libloading) ' || true)
[ -z "$io_crates" ] || { printf 'djinn-proto depends on I/O or device crates:\n%s\n' "$io_crates" >&2; exit 1; }
# The Python package's extension builds the transports without the node's poller.
cargo clippy -p djinn-dataplane --all-targets --locked -- -D warnings
poller_crates=$(cargo tree -p djinn-python -e normal --prefix none --locked | grep -E '^(mio|io-uring|cudarc) ' || true)
[ -z "$poller_crates" ] || { printf 'the Python extension depends on the node poller or CUDA:\n%s\n' "$poller_crates" >&2; exit 1; }

step "cargo test"
cargo test --workspace --locked

step "the docs' runnable shell blocks"
python3 scripts/doc-blocks.py "$PWD/target/debug"

step "python tests (the real extension against a real node)"
DJINN_BIN="$PWD/target/debug/djinn" .venv/bin/python -m pytest -q client-lib/python/tests

step "the GPU suite on this build (no GPU here: its GPU parts are reported skipped)"
TORCH_VENV="$PWD/.venv" DJINN_BIN="$PWD/target/debug/djinn" scripts/gpu-suite.sh target/gpu-suite

step "RDMA tests in the soft-RoCE VM (qemu, TCG: minutes)"
# Python is slow to start under emulation: the models the tests register are made here.
models="$PWD/target/test-models"
.venv/bin/python tests/models/make_models.py "$models" >/dev/null 2>&1
rdma_tests=$(cargo test -p djinn --test rdma --no-run --locked --message-format=json 2>/dev/null |
  .venv/bin/python -c 'import json, sys
found = [m["executable"] for m in map(json.loads, sys.stdin)
         if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "rdma" and m.get("executable")]
print(found[-1])')
DJINN_TEST_MODELS="$models" scripts/softroce-vm.sh -- "$rdma_tests" --test-threads=1

step "all tests passed"
