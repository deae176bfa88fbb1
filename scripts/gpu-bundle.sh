#!/usr/bin/env bash
# Builds, on a development machine, the bundle that runs Djinn's GPU suite on a GPU host that
# has PyTorch but no Rust and no network: the stripped `djinn` binary and the test binaries the
# suite runs, built against the host's torch release and finding its libtorch through an rpath;
# the Python package with its abi3 extension; gpu-suite.sh and the scripts it needs.
#
#   scripts/gpu-bundle.sh [--torch 2.11|2.13] [--torch-lib DIR] [--out FILE]
#
# --torch: the host's torch release (default 2.11; a venv with that torch is made here, in
# .venv-torch<release>, to build against). --torch-lib: the host's torch/lib, the binaries'
# rpath (default /opt/torch/.venv/lib/python3.12/site-packages/torch/lib; gpu-suite.sh also sets
# LD_LIBRARY_PATH from TORCH_VENV). --out: the archive (default target/djinn-gpu-bundle.tar.gz).
# On the host: tar xzf djinn-gpu-bundle.tar.gz && djinn-gpu/gpu-suite.sh OUT
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=2.11
TORCH_LIB=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib
OUT=target/djinn-gpu-bundle.tar.gz
MAX_MIB=60
while (($#)); do
  case $1 in
    --torch) TORCH=$2; shift 2 ;;
    --torch-lib) TORCH_LIB=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "usage: $0 [--torch 2.11|2.13] [--torch-lib DIR] [--out FILE]" >&2; exit 2 ;;
  esac
done
log() { printf '[gpu-bundle] %s\n' "$*" >&2; }

# The torch releases a build can target: the wheels to build against (and to run the suite
# here), and the cargo feature that picks the matching tch.
case $TORCH in
  2.11) PACKAGES=(torch==2.11.0 torchvision==0.26.0); FEATURE=torch-2-11; VENV=.venv-torch2.11 ;;
  2.13) PACKAGES=(torch==2.13.0 torchvision==0.28.0); FEATURE=torch-2-13; VENV=.venv ;;
  *) log "error: torch $TORCH is not a release this build targets (2.11 or 2.13)"; exit 2 ;;
esac

# System packages, Rust, and .venv (maturin for the Python package).
bash scripts/setup.sh --no-build
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(not torch.__version__.startswith('$TORCH.'))" 2>/dev/null; then
  log "installing ${PACKAGES[*]} into $VENV (the CUDA wheels, about 2.6 GB)"
  /usr/bin/python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir "${PACKAGES[@]}" numpy pytest hypothesis
fi
LIBTORCH=$(cd "$("$VENV/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')" && pwd)
export LIBTORCH DJINN_TORCH_RPATH=$TORCH_LIB
TARGET=target/torch-$TORCH
CARGO=(--release --locked --target-dir "$TARGET")
TORCH_ARGS=(-p djinn --no-default-features --features "$FEATURE")

log "building djinn for torch $TORCH (release; minutes the first time)"
cargo build "${CARGO[@]}" "${TORCH_ARGS[@]}" --quiet
# The test binaries, by the name of their test target.
test_binaries() {
  cargo test "${CARGO[@]}" --no-run --message-format=json "$@" 2>/dev/null | "$VENV/bin/python" -c '
import json, sys
for m in map(json.loads, sys.stdin):
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["target"]["name"], m["executable"])'
}
log "building the test binaries"
tests=$(test_binaries "${TORCH_ARGS[@]}" --test stream --test sessions --test breakpoints --test handles)
tests+=$'\n'$(test_binaries -p djinn-gpudirect --lib)

STAGE="$TARGET/bundle/djinn-gpu"
rm -rf "$TARGET/bundle"
mkdir -p "$STAGE/bin" "$STAGE/tests/bin" "$STAGE/tests/models" "$STAGE/bench" \
  "$STAGE/client-lib/python/tests" "$STAGE/client-lib/python/examples"
# Symbols stay (a backtrace on the host names functions); debug info goes.
strip --strip-debug -o "$STAGE/bin/djinn" "$TARGET/release/djinn"
while read -r name path; do
  [ -n "$name" ] || continue
  [ "$name" = djinn_gpudirect ] && name=gpudirect
  strip --strip-debug -o "$STAGE/tests/bin/$name" "$path"
done <<<"$tests"
for t in gpudirect stream sessions breakpoints handles; do
  [ -x "$STAGE/tests/bin/$t" ] || { log "error: no test binary $t"; exit 1; }
done

log "building the Python package (abi3 wheel)"
rm -rf "$TARGET/wheels"
.venv/bin/maturin build --release --quiet -m client-lib/python/Cargo.toml --out "$TARGET/wheels" >/dev/null 2>&1 ||
  .venv/bin/maturin build --release -m client-lib/python/Cargo.toml --out "$TARGET/wheels"
.venv/bin/python -m zipfile -e "$TARGET"/wheels/djinn-*.whl "$STAGE/client-lib/python"
rm -rf "$STAGE"/client-lib/python/djinn-*.dist-info
strip --strip-debug "$STAGE"/client-lib/python/djinn/_native*.so

cp scripts/gpu-suite.sh "$STAGE/gpu-suite.sh"
cp tests/models/make_models.py "$STAGE/tests/models/"
cp bench/agents_model.py "$STAGE/bench/"
cp client-lib/python/tests/conftest.py client-lib/python/tests/test_gpu.py "$STAGE/client-lib/python/tests/"
cp client-lib/python/examples/*.py "$STAGE/client-lib/python/examples/"
echo "$TORCH" >"$STAGE/torch-version"
cat >"$STAGE/README" <<EOF
Djinn's GPU suite, built $(date -u '+%Y-%m-%d') from $(git rev-parse --short HEAD 2>/dev/null || echo "a work tree")
for torch $TORCH (rpath $TORCH_LIB).

  TORCH_VENV=/opt/torch/.venv ./gpu-suite.sh OUT

runs everything that needs a GPU (at most 9 minutes) and writes OUT/summary.md, the table it
prints at the end, beside its logs and OUT/bench-results.md. Needs x86-64 Linux with glibc >= 2.34
and GCC >= 11's libstdc++.
EOF

mkdir -p "$(dirname "$OUT")"
tar czf "$OUT" -C "$TARGET/bundle" djinn-gpu
size=$(stat -c %s "$OUT")
mib=$(((size + (1 << 20) - 1) >> 20))
log "bundle: $OUT, $mib MiB ($size bytes) for torch $TORCH"
if ((mib > MAX_MIB)); then
  log "error: the bundle is over $MAX_MIB MiB"
  exit 1
fi
echo "$OUT $size"
