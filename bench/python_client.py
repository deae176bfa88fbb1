"""Benchmarks of the Python package against a `djinn up` it starts, each beside its local
baseline measured in the same run: TinyMLP and GPT-2-small-shaped execute round trips through
`djinn` against the same model's local forward in this process, and the GPT-2 registration
time. Usage: python bench/python_client.py [--results bench/RESULTS.md]"""
import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client-lib" / "python" / "examples"))
import djinn  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from percentiles import percentiles  # noqa: E402

torch.set_num_threads(1)  # as the node computes


def timed(fn, iters, warmup, per=1):
    """p50/p99/p999 of `fn`'s time in µs, divided by `per` (per operation of it, say)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) / per)
    return percentiles([t * 1e6 for t in out])


def table_of(rows):
    """The rows (name, (p50, p99, p999)) as a markdown table (which bench/compare_builds.py reads)."""
    return ["| what | p50 µs | p99 µs | p999 µs |", "|---|---|---|---|"] + [
        f"| {name} | {p50:.1f} | {p99:.1f} | {p999:.1f} |" for name, (p50, p99, p999) in rows
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--results")
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--gpt-iters", type=int, default=20)
    ap.add_argument("--tinymlp-only", action="store_true", help="skip the GPT-2 rows (A/B runs of the call path)")
    args = ap.parse_args()
    binary = os.environ.get("DJINN_BIN", str(ROOT / "target" / "release" / "djinn"))
    node = subprocess.Popen([binary, "up", "--listen", "127.0.0.1:0", "--log", "warn"], stdout=subprocess.PIPE)
    try:
        address = node.stdout.readline().decode().split()[-1]
        djinn.init(address)
        rows = []

        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).eval()
        x = torch.randn(4, 256)
        rm = djinn.register(mlp, x)
        with torch.no_grad():
            local = timed(lambda: mlp(x), args.iters, args.iters // 10)
        remote = timed(lambda: rm(x), args.iters, args.iters // 10)
        rows.append(("TinyMLP through `djinn` (Python), batch 4, f32", remote))
        rows.append(("TinyMLP eager forward in this process", local))
        if args.tinymlp_only:
            print("\n".join(table_of(rows)))
            print(f"\nTinyMLP: remote p50 − local p50 = {remote[0] - local[0]:.1f} µs")
            return

        torch.manual_seed(0)
        gpt = GPT(GPTConfig.small()).eval()
        idx = torch.randint(0, gpt.config.vocab, (1, 64))
        t = time.perf_counter()
        g = djinn.register(gpt, idx, blocks=gpt.blocks())
        registration = time.perf_counter() - t
        t = time.perf_counter()
        djinn.register(gpt, idx, blocks=gpt.blocks())
        reregistration = time.perf_counter() - t
        with torch.no_grad():
            expected = gpt(idx)
            gpt_local = timed(lambda: gpt(idx), args.gpt_iters, 2)
        diff = (g(idx) - expected).abs().max().item()
        gpt_remote = timed(lambda: g(idx), args.gpt_iters, 2)
        rows.append(("GPT-2-small-shaped (124M, 14 blocks) through `djinn`, batch 1, 64 tokens", gpt_remote))
        rows.append(("GPT-2-small-shaped eager forward in this process", gpt_local))
    finally:
        node.terminate()
        node.wait(10)

    table = table_of(rows)
    table.append("")
    table.append(f"TinyMLP: remote p50 − local p50 = **{remote[0] - local[0]:.1f} µs**.  ")
    table.append(f"GPT-2-small-shaped: remote p50 / local p50 = **{gpt_remote[0] / gpt_local[0]:.3f}**; "
                 f"largest difference from the local output {diff:.3g}.  ")
    table.append(f"GPT-2-small-shaped registration (script 14 blocks, check, serialise, upload 622 MiB, load): "
                 f"**{registration:.2f} s**; registering it again (the node already holds it): {reregistration:.2f} s.")
    text = "\n".join(table)
    print(text)
    if args.results:
        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
        header = (f"\n### `python bench/python_client.py` — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n\n"
                  f"Command: `{' '.join(sys.argv)}`  \nMachine: {os.cpu_count()} × {cpu}; torch {torch.__version__}, "
                  f"one thread per operation on both sides\n\n")
        with open(args.results, "a") as f:
            f.write(header + text + "\n")
        print("appended to", args.results)


if __name__ == "__main__":
    main()
