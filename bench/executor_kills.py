"""What killing one tenant's executor process costs the other tenant, and how soon the hit tenant
is served again: a node with `--executor-processes`, two tenants (alice, bob) each with a small
MLP, bob calling in a loop throughout. Phases come in threes: a quiet one (alice idle), one in
which alice calls in a loop too, and one in which she calls and her process is killed once, by
SIGSEGV (sent until it dies: the Rust runtime takes the first one that no fault raised) or by
SIGKILL, in turn. Prints bob's p50/p99/p999 over each kind of phase and the kill phases' ratios
to the others (the issue's bound: p99 within 2x of unloaded; on a machine of 2 cores alice's own
calls take a share of them, so the ratio to the phases where she calls without a kill is the
kill's own cost), bob's failed calls (0 expected), alice's errors by type (ExecutorLostError
only) and, for each kill, how long until alice's next call succeeded (her models come back
without an upload), counted from when her old process was gone.

Usage: .venv/bin/python bench/executor_kills.py [--node target/release/djinn] [--calls 2000]
           [--kills 3] [--results FILE]
"""
import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client-lib" / "python"))
sys.path.insert(0, str(ROOT / "client-lib" / "python" / "tests"))
import djinn  # noqa: E402
from percentiles import percentiles  # noqa: E402
from test_executor_processes import executor_processes  # noqa: E402

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789ab"


def end(pid: int, sig: int):
    """Sends `sig` until the process is gone (at most 100 times)."""
    for _ in range(100):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        time.sleep(0.01)
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except OSError:
            return
    raise RuntimeError(f"process {pid} outlived 100 signals {sig}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", default=str(ROOT / "target" / "release" / "djinn"))
    ap.add_argument("--calls", type=int, default=2000, help="bob's calls per phase")
    ap.add_argument("--kills", type=int, default=3, help="kill phases (each after a quiet one)")
    ap.add_argument("--results", help="append the figures to this file")
    args = ap.parse_args()

    tokens = Path(tempfile.mkdtemp()) / "tokens.json"
    tokens.write_text(json.dumps({"principals": [{"name": "alice", "tokens": [ALICE]}, {"name": "bob", "tokens": [BOB]}]}))
    node = subprocess.Popen(
        [args.node, "node", "--listen", "127.0.0.1:0", "--log", "error", "--executor-processes", "--auth-file", str(tokens)],
        stdout=subprocess.PIPE,
    )
    try:
        address = node.stdout.readline().decode().split()[-1]
        torch.manual_seed(0)
        torch.set_num_threads(1)
        mlp = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).eval()
        x = torch.randn(4, 256)
        alice, bob = djinn.Client(address, token=ALICE), djinn.Client(address, token=BOB)
        alices, bobs = alice.register(mlp, x), bob.register(mlp, x)
        alices(x)
        bob_pid = next(p for p, cmd in executor_processes(node.pid).items() if "--first-id=1 " not in cmd)
        for _ in range(200):
            bobs(x)

        quiet, loaded, killed, bob_failures = [], [], [], []
        alice_errors, recoveries = {}, []

        def bob_phase(into):
            for _ in range(args.calls):
                started = time.perf_counter_ns()
                try:
                    bobs(x)
                except djinn.DjinnError as e:
                    bob_failures.append(repr(e))
                    continue
                into.append(time.perf_counter_ns() - started)

        def alice_calls(stop):
            while not stop.is_set():
                alices(x)

        for phase in range(args.kills):
            bob_phase(quiet)
            stop = threading.Event()
            calling = threading.Thread(target=alice_calls, args=(stop,))
            calling.start()
            bob_phase(loaded)
            stop.set()
            calling.join()
            stop, killed_at, served_after = threading.Event(), [], []

            def alice_loop():
                while not stop.is_set():
                    try:
                        started = time.perf_counter()
                        alices(x)
                        # Served by her new process: a call begun after the old one was gone.
                        if killed_at and started >= killed_at[0] and not served_after:
                            served_after.append(time.perf_counter() - killed_at[0])
                    except djinn.DjinnError as e:
                        alice_errors[type(e).__name__] = alice_errors.get(type(e).__name__, 0) + 1

            def killer():
                time.sleep(0.1)
                target = next(p for p in executor_processes(node.pid) if p != bob_pid)
                end(target, signal.SIGSEGV if phase % 2 == 0 else signal.SIGKILL)
                killed_at.append(time.perf_counter())

            threads = [threading.Thread(target=alice_loop), threading.Thread(target=killer)]
            for t in threads:
                t.start()
            bob_phase(killed)
            threads[1].join()
            deadline = time.monotonic() + 30
            while not served_after and time.monotonic() < deadline:
                time.sleep(0.01)
            stop.set()
            threads[0].join()
            recoveries.append(served_after[0] if served_after else None)
        bob_lived = bob_pid in executor_processes(node.pid)
    finally:
        node.terminate()
        node.wait()

    q, l, k = percentiles(quiet), percentiles(loaded), percentiles(killed)
    lines = [
        f"machine: {platform.node()}, {os.cpu_count()} CPUs; {args.kills} kill phases, {args.calls} of bob's calls per phase",
        f"bob, quiet phases:  p50 {q[0] / 1e3:.1f} us  p99 {q[1] / 1e3:.1f} us  p999 {q[2] / 1e3:.1f} us",
        f"bob, alice calling: p50 {l[0] / 1e3:.1f} us  p99 {l[1] / 1e3:.1f} us  p999 {l[2] / 1e3:.1f} us",
        f"bob, kill phases:   p50 {k[0] / 1e3:.1f} us  p99 {k[1] / 1e3:.1f} us  p999 {k[2] / 1e3:.1f} us",
        f"kill / quiet:          p50 {k[0] / q[0]:.2f}  p99 {k[1] / q[1]:.2f}  p999 {k[2] / q[2]:.2f}",
        f"kill / alice calling:  p50 {k[0] / l[0]:.2f}  p99 {k[1] / l[1]:.2f}  p999 {k[2] / l[2]:.2f}",
        f"bob's failed calls: {len(bob_failures)}; bob's process lived through: {bob_lived}",
        f"alice's errors: {alice_errors}",
        "alice served again after each kill (SIGSEGV, SIGKILL in turn): "
        + ", ".join("never" if r is None else f"{r * 1e3:.0f} ms" for r in recoveries),
    ]
    print("\n".join(lines))
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n".join(lines) + "\n")
    if bob_failures or not bob_lived or None in recoveries or set(alice_errors) - {"ExecutorLostError"}:
        sys.exit(f"bob failed {bob_failures[:3]}, or alice was not served again, or got untyped errors")


if __name__ == "__main__":
    main()
