"""Whether one session's swaps hold up a node's other requests: one client's pings, timed alone
and while another client's session moves a large state out to host memory and back (IO_WAIT,
then COMPUTE, each acknowledged at once and carried out by a worker, then a step, whose reply
says both are done), in alternating phases of one run on one node: in each swapping phase the
session swaps out and back `--cycles` times and the other client pings throughout; each quiet
phase takes as many pings. The ratio of the two p99s is the head-of-line blocking a swap
causes at the node's poller: about 1 when the poller never waits on a worker's copy (on a
machine with a core to spare for the copy).

Usage: .venv/bin/python bench/swap_isolation.py [--node target/release/djinn] [--state-mib 256]
           [--cycles 5] [--phases 4] [--results FILE]
"""
import argparse
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client-lib" / "python"))
import djinn  # noqa: E402
from percentiles import percentiles  # noqa: E402



class Carry(nn.Module):
    """A session's model: its state passes through each step unchanged."""

    def forward(self, x: torch.Tensor, state: torch.Tensor):
        return x * 2, state


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", default=str(ROOT / "target" / "release" / "djinn"))
    ap.add_argument("--state-mib", type=int, default=256)
    ap.add_argument("--cycles", type=int, default=5, help="swaps out and back per swapping phase")
    ap.add_argument("--phases", type=int, default=4, help="phases of each kind, alternating")
    ap.add_argument("--results")
    args = ap.parse_args()
    state_bytes = args.state_mib << 20
    budget = str(2 * state_bytes + (64 << 20))
    node = subprocess.Popen(
        [args.node, "node", "--listen", "127.0.0.1:0", "--log", "warn", "--session-policy", "semantic",
         "--session-budget", budget, "--session-host-pool", budget],
        stdout=subprocess.PIPE)
    try:
        address = node.stdout.readline().decode().split()[-1]
        swapper, pinger = djinn.Client(address), djinn.Client(address)
        model = Carry().eval()
        state = torch.zeros(state_bytes // 4)
        example = (torch.ones(4), state)
        rm = swapper.register(model, example, blocks=[torch.jit.script(model)])
        session = rm.session(state)
        session.step(torch.ones(4))

        def swap():
            # As an agent does: a tool call (the state goes out), then back to work (it comes
            # back); the step's reply says both are done.
            for _ in range(args.cycles):
                session.io_wait()
                session.compute()
                session.step(torch.ones(4))

        alone, swapping = [], []
        swaps_before = pinger.node_stats()["session_swaps_out"]
        for phase in range(args.phases):
            thread = threading.Thread(target=swap)
            thread.start()
            taken = 0
            while thread.is_alive():
                swapping.append(pinger.ping() * 1e6)
                taken += 1
            thread.join()
            alone.extend(pinger.ping() * 1e6 for _ in range(taken))
            print(f"phase {phase + 1}/{args.phases}: {taken} pings each way", file=sys.stderr)
        swaps = pinger.node_stats()["session_swaps_out"] - swaps_before
        session.close()
    finally:
        node.terminate()
        node.wait()
    a, s = percentiles(alone), percentiles(swapping)
    lines = [
        f"### `bench/swap_isolation.py` — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"Command: `.venv/bin/python bench/swap_isolation.py --node {args.node} --state-mib {args.state_mib} "
        f"--cycles {args.cycles} --phases {args.phases}`  ",
        f"Machine: {os.cpu_count()} cores, {platform.platform()}; torch {torch.__version__}  ",
        f"A session of {args.state_mib} MiB of state swapped out and back {swaps} times by one client while "
        f"another pings the node throughout; {len(swapping)} pings while swapping and as many alone, "
        f"in {args.phases} pairs of phases.",
        "",
        "| pings | p50 µs | p99 µs | p999 µs |",
        "|---|---|---|---|",
        f"| alone | {a[0]:.1f} | {a[1]:.1f} | {a[2]:.1f} |",
        f"| while another session swaps | {s[0]:.1f} | {s[1]:.1f} | {s[2]:.1f} |",
        "",
        f"While swapping / alone: p50 **{s[0] / a[0]:.2f}×**, p99 **{s[1] / a[1]:.2f}×**, "
        f"p999 **{s[2] / a[2]:.2f}×**.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
