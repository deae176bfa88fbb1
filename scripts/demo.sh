#!/usr/bin/env bash
# The main job on one machine: installs what is missing, starts a node, moves a tensor through
# it (put, get back, compare), lists and deletes it, then stops the node with SIGINT.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BIN=target/release/djinn
tmp=$(mktemp -d)
node_pid=""
cleanup() { [ -n "$node_pid" ] && kill "$node_pid" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT

"$BIN" node --listen 127.0.0.1:0 --device-memory-budget 1GiB >"$tmp/node.out" 2>"$tmp/node.log" &
node_pid=$!
for _ in $(seq 200); do [ -s "$tmp/node.out" ] && break; sleep 0.05; done
addr=$(awk '{print $NF; exit}' "$tmp/node.out")
[ -n "$addr" ] || { cat "$tmp/node.log" >&2; echo "the node did not start" >&2; exit 1; }
echo "== node at $addr"

"$BIN" ping "$addr" --count 3

echo "== a 1024×1024 f32 tensor (4 MiB) goes to the node and back"
head -c $((4 << 20)) /dev/urandom >"$tmp/in.bin"
"$BIN" put "$addr" weights --dtype f32 --shape 1024,1024 --file "$tmp/in.bin"
"$BIN" get "$addr" weights --out "$tmp/out.bin"
cmp "$tmp/in.bin" "$tmp/out.bin"
echo "byte-exact"
"$BIN" ls "$addr"
"$BIN" stats "$addr" | grep -E '^(store_|budget_|bytes_)'
"$BIN" rm "$addr" weights

kill -INT "$node_pid"
wait "$node_pid"
node_pid=""
echo "== node stopped cleanly"
