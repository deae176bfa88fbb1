#!/usr/bin/env bash
# The main job on one machine: installs what is missing, starts `djinn up`, registers a
# GPT-2-small-shaped transformer (124M parameters, random weights, built in code) split into
# one block per layer, executes it remotely and prints the largest difference from the local
# result, the registration time and the execute latency. Then stops the node with SIGINT.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BIN=target/release/djinn
tmp=$(mktemp -d)
node_pid=""
cleanup() { [ -n "$node_pid" ] && kill "$node_pid" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT

"$BIN" up --listen 127.0.0.1:0 >"$tmp/node.out" 2>"$tmp/node.log" &
node_pid=$!
for _ in $(seq 600); do [ -s "$tmp/node.out" ] && break; sleep 0.05; done
addr=$(awk '{print $NF; exit}' "$tmp/node.out")
[ -n "$addr" ] || { cat "$tmp/node.log" >&2; echo "the node did not start" >&2; exit 1; }
echo "== djinn up: node at $addr"
"$BIN" ping "$addr" --count 3

echo "== GPT-2-small-shaped model, registered once, executed remotely"
PYTHONPATH=client-lib/python/examples .venv/bin/python client-lib/python/examples/demo_gpt2.py "$addr"

echo "== what the node holds"
"$BIN" stats "$addr" | grep -E '^(models|model_bytes|executions|budget_used_bytes)'
kill -INT "$node_pid"
wait "$node_pid"
node_pid=""
echo "== node stopped cleanly"
