"""Counters of what this process's Python client did, beside the native client's own."""

import threading

_lock = threading.Lock()

# Input tensors the client had to copy before sending (not on the CPU, or not contiguous: a
# contiguous CPU tensor is sent from its own memory).
wire = {"input_copies": 0, "input_copy_bytes": 0}

# What transparent capture did.
capture = {
    "ops_captured": 0,
    "graphs_built": 0,
    "graph_cache_hits": 0,
    "graph_executions": 0,
    "uploads": 0,
    "random_results_kept": 0,
    "state_kept": 0,
    # Nanoseconds spent writing graphs, registering new ones, and in executes (the wire and
    # the node): what a captured run costs besides recording.
    "write_ns": 0,
    "register_ns": 0,
    "execute_ns": 0,
}


def count(table: dict, key: str, n: int = 1) -> None:
    with _lock:
        table[key] += n


def snapshot(table: dict) -> dict:
    with _lock:
        return dict(table)
