#!/usr/bin/env bash
# The main job on one machine: installs what is missing, starts `djinn up` (the control plane
# on its embedded store, and one node), registers a GPT-2-small-shaped transformer (124M
# parameters, random weights, built in code) split into one block per layer through the control
# plane, executes it remotely and prints the placement, the largest difference from the local
# result, the registration time and the execute latency; then `djinn status`. Then stops
# `djinn up` with SIGINT.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BIN=target/release/djinn
tmp=$(mktemp -d)
node_pid=""
cleanup() { [ -n "$node_pid" ] && kill "$node_pid" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT

"$BIN" up --listen 127.0.0.1:0 --control-listen 127.0.0.1:0 --store "$tmp/control.redb" \
  >"$tmp/up.out" 2>"$tmp/up.log" &
node_pid=$!
# Two lines: the control plane's address, then the node's.
for _ in $(seq 600); do [ "$(wc -l <"$tmp/up.out")" -ge 2 ] && break; sleep 0.05; done
control=$(awk '/^djinn control listening on/ {print $NF; exit}' "$tmp/up.out")
addr=$(awk '/^djinn node listening on/ {print $NF; exit}' "$tmp/up.out")
[ -n "$addr" ] && [ -n "$control" ] || { cat "$tmp/up.log" >&2; echo "djinn up did not start" >&2; exit 1; }
echo "== djinn up: control plane at $control, node at $addr"
"$BIN" ping "$addr" --count 3
# The node joins within a moment of starting.
for _ in $(seq 100); do "$BIN" status --control "$control" --json | grep -q '"nodes":\[{' && break; sleep 0.1; done

echo "== GPT-2-small-shaped model, placed by the control plane, registered once, executed remotely"
PYTHONPATH=client-lib/python/examples .venv/bin/python client-lib/python/examples/demo_gpt2.py "http://$control"

echo "== a session: greedy decoding with the KV cache kept on the node between steps"
PYTHONPATH=client-lib/python/examples .venv/bin/python client-lib/python/examples/demo_session.py "http://$control"

echo "== djinn status"
"$BIN" status --control "$control"

echo "== what the node holds"
"$BIN" stats "$addr" | grep -E '^(models|model_bytes|executions|budget_used_bytes)'
kill -INT "$node_pid"
wait "$node_pid"
node_pid=""
echo "== djinn up stopped cleanly"
