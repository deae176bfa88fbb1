#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian 12 machine: system packages, the Python venv with the
# libtorch that `tch` needs, and a release build of the workspace. A second run only checks.
# `--no-build` skips the release build of the workspace (scripts/test.sh builds what it tests).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=1
[ "${1:-}" = "--no-build" ] && BUILD=0

APT_PACKAGES=(build-essential pkg-config cmake libclang-dev libibverbs-dev librdmacm-dev
  rdma-core ibverbs-utils python3-venv python3-dev
  # The control plane: etcd-client's build needs protoc and the well-known protos; the etcd
  # tests start a real etcd.
  protobuf-compiler libprotobuf-dev etcd-server
  # test_tls.py makes its certificates with openssl.
  openssl
  # scripts/softroce-vm.sh: a qemu VM with Debian's generic kernel (it has rdma_rxe), busybox-static
  # for its initramfs, perftest to validate rxe0.
  qemu-system-x86 seabios linux-image-amd64 busybox-static kmod cpio iproute2 perftest)
TORCH_VERSION=2.13.0
# torchvision and transformers: models no one here wrote, for the tests (built from their
# configs with random weights, no download); 0.28.0 is torchvision's release for torch 2.13.0,
# transformers 5.17.0 the one GPU hosts have.
PY_PACKAGES=("torch==${TORCH_VERSION}" "torchvision==0.28.0" "transformers==5.17.0" "numpy>=1.26" "maturin>=1.16,<2" "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100")

log() { printf '[setup] %s\n' "$*" >&2; }

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  aptlog=$(mktemp)
  if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
      --no-install-recommends "${missing[@]}"; } >"$aptlog" 2>&1; then
    cat "$aptlog" >&2
    exit 1
  fi
  rm -f "$aptlog"
fi

if ! command -v cargo >/dev/null 2>&1; then
  log "installing the Rust toolchain (rustup, stable)"
  curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --component clippy,rustfmt
  # shellcheck disable=SC1091
  . "$HOME/.cargo/env"
fi

# Debian's interpreter, so python3-venv and python3-dev match it.
PYTHON=/usr/bin/python3
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python - <<PY 2>/dev/null
import importlib.metadata as m, sys
ok = m.version("torch") == "${TORCH_VERSION}" and m.version("transformers") == "5.17.0" and all(m.version(p) for p in ("torchvision", "numpy", "maturin", "pytest", "pytest-timeout", "hypothesis"))
sys.exit(0 if ok else 1)
PY
then
  # The wheels (2.6 GB) are downloaded to the temporary folder, then unpacked into .venv (4.8 GB).
  need_gib=8
  for where in .venv "${TMPDIR:-/tmp}"; do
    free_gib=$(($(df -Pk "$where" | awk 'NR == 2 { print $4 }') / 1024 / 1024))
    if ((free_gib < need_gib)); then
      log "error: torch needs about ${need_gib} GiB free; $(realpath "$where") has ${free_gib} GiB"
      exit 1
    fi
  done
  log "installing ${PY_PACKAGES[*]} into .venv (torch is the CUDA build, about 2.6 GB)"
  # No cache: it would hold a second copy of the wheels.
  .venv/bin/pip install -q --disable-pip-version-check --no-cache-dir "${PY_PACKAGES[@]}"
fi

# The Python package: the PyO3 extension built with maturin and installed (editable) into .venv.
log "building and installing the Python package djinn into .venv"
VIRTUAL_ENV="$PWD/.venv" .venv/bin/maturin develop --release --quiet -m client-lib/python/Cargo.toml \
  >/dev/null 2>.venv/maturin.log || { cat .venv/maturin.log >&2; exit 1; }

if [ "$BUILD" = 1 ]; then
  log "building the workspace (release)"
  cargo build --release --workspace --locked --quiet
  log "ready: target/release/djinn"
fi
