"""Transparent capture, against a `djinn node` it starts, each figure beside its baseline
measured in the same run:
- capture overhead per operation: recording a forward (meta shapes, no data, nothing runs),
  per aten operation, beside the same forward run eagerly here, per operation;
- a cached graph's execute latency: `model(x).cpu()` on a module moved to remote_accelerator:0
  (capture, graph cache look-up, execute, fetch), beside `rm(x)` of the same module registered
  with `djinn.register`.
Models: an MLP (256-1024-256, batch 4) and the tiny GPT (2 layers, width 64, 16 tokens).
Usage: python bench/capture.py [--results bench/RESULTS.md] [--iters N]"""
import argparse
import copy
import datetime
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from python_client import ROOT, timed  # noqa: E402  (also puts the examples on the path)

import djinn  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def ops_of(forward) -> int:
    before = djinn.stats()["capture"]["ops_captured"]
    forward()
    return djinn.stats()["capture"]["ops_captured"] - before


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--results")
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    binary = os.environ.get("DJINN_BIN", str(ROOT / "target" / "release" / "djinn"))
    node = subprocess.Popen([binary, "node", "--listen", "127.0.0.1:0", "--log", "warn"], stdout=subprocess.PIPE)
    rows = []
    try:
        djinn.init(node.stdout.readline().decode().split()[-1])
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).eval()
        x = torch.randn(4, 256)
        gpt = GPT(GPTConfig.tiny()).eval()
        idx = torch.randint(0, gpt.config.vocab, (1, 16))
        for name, model, inputs, iters in [("MLP 256-1024-256, batch 4", mlp, x, args.iters),
                                           ("tiny GPT, 16 tokens", gpt, idx, args.iters // 4)]:
            local = copy.deepcopy(model)
            rm = djinn.register(local, inputs)
            model.to("remote_accelerator:0")
            with torch.no_grad():
                ops = ops_of(lambda: model(inputs))
                capture = timed(lambda: model(inputs), iters, iters // 10, per=ops)
                eager = timed(lambda: local(inputs), iters, iters // 10, per=ops)
                expected = local(inputs)
                diff = (model(inputs).cpu() - expected).abs().max().item()
                cached = timed(lambda: model(inputs).cpu(), iters, iters // 10)
            registered = timed(lambda: rm(inputs), iters, iters // 10)
            rows.append((name, ops, capture, eager, cached, registered, diff))
        stats = djinn.stats()["capture"]
    finally:
        node.terminate()
        node.wait(10)

    table = [
        "| model | aten ops | capture per op p50 / p99 / p999 µs | eager per op p50 / p99 / p999 µs | ratio | "
        "cached graph `model(x).cpu()` p50 / p99 / p999 µs | registered `rm(x)` p50 / p99 / p999 µs | ratio | largest difference |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda p: " / ".join(f"{v:.1f}" for v in p)  # noqa: E731
    for name, ops, capture, eager, cached, registered, diff in rows:
        table.append(
            f"| {name} | {ops} | {fmt(capture)} | {fmt(eager)} | **{capture[0] / eager[0]:.1f}** | {fmt(cached)} | "
            f"{fmt(registered)} | **{cached[0] / registered[0]:.2f}** | {diff:.3g} |"
        )
    table.append("")
    table.append(f"Graphs built: {stats['graphs_built']}, graph cache hits: {stats['graph_cache_hits']}.")
    text = "\n".join(table)
    print(text)
    if args.results:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
        header = (
            f"\n### `python bench/capture.py` — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n\n"
            f"Command: `{' '.join(sys.argv)}`  \nMachine: {os.cpu_count()} × {cpu}; torch {torch.__version__}, "
            f"one thread per operation on both sides, node on CPU over loopback TCP\n\n"
        )
        with open(args.results, "a") as f:
            f.write(header + text + "\n")
        print("appended to", args.results)


if __name__ == "__main__":
    main()
