#!/usr/bin/env bash
# Every test: installs what is missing, then clippy (warnings are errors), the Rust tests
# (unit, property and integration tests against real node processes), and the Python tests
# once the Python package has them. `.ci/run` calls this on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --no-build

step() { printf '\n== %s\n' "$*" >&2; }

step "rustfmt, clippy"
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test"
cargo test --workspace --locked

step "python tests (the real extension against a real node)"
DJINN_BIN="$PWD/target/debug/djinn" .venv/bin/python -m pytest -q client-lib/python/tests

step "all tests passed"
