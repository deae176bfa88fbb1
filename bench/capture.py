"""Transparent capture, against a `djinn node` it starts, each figure beside its baseline
measured in the same run:
- capture overhead per operation: recording a forward (meta shapes, no data, nothing runs),
  per aten operation, beside the same forward run eagerly here, per operation;
- a cached graph's execute latency: `model(x).cpu()` on a module moved to remote_accelerator:0
  (capture, graph cache look-up, execute, fetch), beside `rm(x)` of the same module registered
  with `djinn.register`;
- Hugging Face `generate` of 16 tokens on a 4-layer GPT-2 (width 768, random weights) through
  capture, beside the same `generate` locally, with how the captured run's time splits:
  writing graphs, registering new ones, the node (its workers' time on the executions, from
  its `execution_us` counter), the wire (the executes' time less the node's), and the rest
  (the model's and generate's Python, and recording), the node's part beside the local
  forwards of the same steps.
Models: an MLP (256-1024-256, batch 4) and the tiny GPT (2 layers, width 64, 16 tokens).
Usage: python bench/capture.py [--results bench/RESULTS.md] [--iters N] [--generate-runs N]"""
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
    ap.add_argument("--generate-runs", type=int, default=3)
    args = ap.parse_args()
    binary = os.environ.get("DJINN_BIN", str(ROOT / "target" / "release" / "djinn"))
    node = subprocess.Popen([binary, "node", "--listen", "127.0.0.1:0", "--log", "warn"], stdout=subprocess.PIPE)
    rows = []
    try:
        client = djinn.init(node.stdout.readline().decode().split()[-1])
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
        generate_rows = generate(client, args.generate_runs)
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
    table.append("")
    table += generate_rows
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


def generate(client, runs: int) -> list:
    """Hugging Face GPT-2 (4 layers) `generate` of 16 tokens: locally, then through capture."""
    import time

    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4)).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 8))
    forward_s = []
    local_forward = model.forward

    def timed_forward(*a, **k):
        t = time.perf_counter()
        out = local_forward(*a, **k)
        forward_s.append(time.perf_counter() - t)
        return out

    local_s = []
    with torch.no_grad():
        for _ in range(runs):
            forward_s.clear()
            model.forward = timed_forward
            t = time.perf_counter()
            want = model.generate(prompt, max_new_tokens=16, do_sample=False)
            local_s.append(time.perf_counter() - t)
            model.forward = local_forward
        steps_local = sum(forward_s)
        model.to("remote_accelerator:0")
        remote = prompt.to("remote_accelerator:0")
        rows = ["| `generate`, 16 tokens, GPT-2 4 layers | total s | writing graphs s | registering s | node s | "
                "wire s | the rest (Python, recording) s | operations recorded | graphs built |",
                "|---|---|---|---|---|---|---|---|---|"]
        captured_s = []
        for run in range(runs):
            before, node_before = djinn.stats()["capture"], client.node_stats()["execution_us"]
            t = time.perf_counter()
            got = model.generate(remote, max_new_tokens=16, do_sample=False).cpu()
            total = time.perf_counter() - t
            after, node_s = djinn.stats()["capture"], (client.node_stats()["execution_us"] - node_before) / 1e6
            assert got.tolist() == want.tolist(), "captured generate differs from local"
            d = {k: (after[k] - before[k]) for k in ("write_ns", "register_ns", "execute_ns", "graphs_built", "ops_captured")}
            write, register, wire = d["write_ns"] / 1e9, d["register_ns"] / 1e9, d["execute_ns"] / 1e9 - node_s
            rows.append(f"| through capture, run {run + 1} | {total:.3f} | {write:.3f} | {register:.3f} | {node_s:.3f} | "
                        f"{wire:.3f} | {total - write - register - node_s - wire:.3f} | {d['ops_captured']} | "
                        f"{d['graphs_built']} |")
            captured_s.append((total, node_s))
    local_p50 = sorted(local_s)[len(local_s) // 2]
    rows.append(f"| locally (eager, one thread), p50 of {runs} | {local_p50:.3f} | | | {steps_local:.3f} (its forwards) "
                f"| | | | |")
    best, best_node = min(captured_s)
    rows.append("")
    rows.append(f"Captured `generate` / local: first run **{captured_s[0][0] / local_p50:.2f}×**, best later run "
                f"**{best / local_p50:.2f}×** (target ≤ 3×); the node's part / the local forwards of the same "
                f"steps: **{best_node / steps_local:.2f}×** (target ≤ 1.2×).")
    return rows


if __name__ == "__main__":
    main()
