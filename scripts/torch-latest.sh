#!/usr/bin/env bash
# The client under the newest torch on PyPI (default 2.15.0; TORCH_LATEST=X.Y.Z for another):
# a venv of its own (.venv-torch-latest: torch, transformers), the package from the source tree
# with the extension scripts/setup.sh built, against a node of this tree. Registers models as
# graphs (whole, split, `blocks=`, with a KV cache) and captures Hugging Face GPT-2's forward
# and `generate`, each compared with the local result; fails if any of it calls torch.jit or
# shows a deprecation warning (DeprecationWarning, FutureWarning, PendingDeprecationWarning).
# About 6 GB of wheels on the first run (PyPI's torch is the CUDA build); not part of test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${TORCH_LATEST:-2.15.0}
VENV=.venv-torch-latest
log() { printf '[torch-latest] %s\n' "$*" >&2; }

bash scripts/setup.sh
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch') != '$VERSION')" 2>/dev/null; then
  log "installing torch $VERSION and transformers 5.17.0 into $VENV"
  /usr/bin/python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir "torch==$VERSION" "transformers==5.17.0" "numpy>=1.26"
fi
DJINN_BIN="$PWD/target/release/djinn" PYTHONPATH="$PWD/client-lib/python:$PWD/client-lib/python/examples" \
  "$VENV/bin/python" client-lib/python/tests/torch_latest.py
