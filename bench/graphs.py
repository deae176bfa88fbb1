"""Graphs against TorchScript and against local eager, on one node, each measured in the same
run as its baseline, call for call in turn:

1. the TinyMLP (256 -> 1024 -> 256, batch 4) as a graph against the same model as TorchScript;
2. Hugging Face GPT-2 small (124M, the full config, random weights): its registration time
   (export, upload, the node's check and load) and its forward through the node against the
   local eager forward (one thread each side);
3. the runner's cost per operator: a chain of 256 additions on a one-element tensor against a
   chain of 1, as a graph and as TorchScript;
4. a decode step of GPT-2 small through a djinn session (registered with `cache_len=`: the KV
   cache on the node, written in place, one token sent per step) against the local decode step
   with the same static KV cache (Hugging Face's StaticCache, eager, one thread), and with
   Hugging Face's default DynamicCache for reference.

Usage: .venv/bin/python bench/graphs.py [--node target/release/djinn] [--iters N] [--results FILE]
"""
import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client-lib" / "python"))
import djinn  # noqa: E402
from percentiles import percentiles  # noqa: E402



def interleaved(fa, fb, iters, warmup=20):
    """`fa` and `fb` timed in turn, call for call: a burst of noise on this shared machine hits
    both, not whichever happens to be timed then."""
    for _ in range(warmup):
        fa()
        fb()
    a, b = [], []
    for _ in range(iters):
        for fn, out in ((fa, a), (fb, b)):
            t = time.perf_counter_ns()
            fn()
            out.append((time.perf_counter_ns() - t) / 1e3)
    return percentiles(a), percentiles(b)


def row(what, p):
    return f"| {what} | {p[0]:.1f} | {p[1]:.1f} | {p[2]:.1f} |"


class Chain(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        for _ in range(self.n):
            x = x + 1.0
        return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", default=str(ROOT / "target" / "release" / "djinn"))
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--gpt-iters", type=int, default=30)
    ap.add_argument("--decode-iters", type=int, default=200)
    ap.add_argument("--only-decode", action="store_true", help="only section 4")
    ap.add_argument("--results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    node = subprocess.Popen([args.node, "node", "--listen", "127.0.0.1:0", "--log", "warn"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        address = node.stdout.readline().decode().split()[-1]
        client = djinn.init(address)
        lines = ["| what | p50 µs | p99 µs | p999 µs |", "|---|---|---|---|"]
        notes = []
        if args.only_decode:
            decode(client, args, lines, notes)
            return report(args, lines, notes)

        mlp = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).eval()
        x = torch.randn(4, 256)
        graph = djinn.register(mlp, x)
        # TorchScript as a user with the right scripts it (the client never does).
        script = djinn.register(mlp, x, blocks=[torch.jit.script(mlp)])
        with torch.no_grad():
            assert torch.equal(graph(x), mlp(x)) and torch.equal(script(x), mlp(x))
        g, s = interleaved(lambda: graph(x), lambda: script(x), args.iters)
        lines += [row("TinyMLP as a graph, through the node", g), row("TinyMLP as TorchScript, through the node", s)]
        notes.append(f"TinyMLP graph p50 / TorchScript p50 = **{g[0] / s[0]:.2f}**")

        for n in (1, 256):
            chain = Chain(n)
            one = torch.ones(1)
            cg = djinn.register(chain, one)
            cs = djinn.register(chain, one, blocks=[torch.jit.script(chain)])
            assert torch.equal(cg(one), one + n) and torch.equal(cs(one), one + n)
            if n == 1:
                g1, s1 = interleaved(lambda: cg(one), lambda: cs(one), args.iters)
            else:
                gn, sn = interleaved(lambda: cg(one), lambda: cs(one), args.iters)
        lines += [row("chain of 1 addition, graph", g1), row("chain of 256 additions, graph", gn),
                  row("chain of 1 addition, TorchScript", s1), row("chain of 256 additions, TorchScript", sn)]
        per_graph, per_script = (gn[0] - g1[0]) / 255, (sn[0] - s1[0]) / 255
        notes.append(f"cost per operator, p50: graph **{per_graph:.2f} µs**, TorchScript {per_script:.2f} µs "
                     f"(ratio **{per_graph / per_script:.2f}**)")

        import transformers

        cfg = transformers.GPT2Config(use_cache=False)
        gpt = transformers.GPT2LMHeadModel(cfg).eval()
        ids = torch.randint(0, cfg.vocab_size, (1, 64))
        start = time.perf_counter()
        rg = djinn.register(gpt, {"input_ids": ids}, dynamic={"input_ids": {1: ("seq", 2, 1024)}})
        registration = time.perf_counter() - start
        with torch.no_grad():
            want = gpt(input_ids=ids).logits
        torch.testing.assert_close(rg(input_ids=ids).logits, want)

        def local():
            with torch.no_grad():
                gpt(input_ids=ids)

        remote_t, local_t = interleaved(lambda: rg(input_ids=ids), local, args.gpt_iters, warmup=3)
        lines += [row("GPT-2 small (124M) forward, 64 tokens, through the node", remote_t),
                  row("GPT-2 small forward, local eager (1 thread)", local_t)]
        notes.append(f"GPT-2 small: node p50 / local p50 = **{remote_t[0] / local_t[0]:.3f}** (target ≤ 1.05); "
                     f"registration (export, upload, check, load) **{registration:.1f} s**")
        decode(client, args, lines, notes)
        report(args, lines, notes)
    finally:
        node.terminate()
        node.wait(timeout=10)


def decode(client, args, lines, notes):
    """Section 4: GPT-2 small's decode step through a session against the local one."""
    import transformers
    from djinn.cache import StaticCacheLM

    cfg = transformers.GPT2Config()
    gpt = transformers.GPT2LMHeadModel(cfg).eval()
    prompt_len, cache_len = 16, 16 + args.decode_iters + 40
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len))
    start = time.perf_counter()
    rm = client.register(gpt, {"input_ids": prompt}, dynamic={"input_ids": {1: ("seq", 2, cache_len)}},
                         cache_len=cache_len)
    registration = time.perf_counter() - start
    local = StaticCacheLM(gpt, 1, cache_len)
    tokens = torch.randint(0, cfg.vocab_size, (args.decode_iters + 40, 1, 1))
    with torch.no_grad(), rm.session() as s:
        torch.testing.assert_close(s.step(input_ids=prompt), local(prompt))
        dynamic = gpt(prompt, use_cache=True).past_key_values
        # Each pair of calls decodes the same token on both sides (the remote one first).
        step = [0]

        def remote_step():
            s.step(input_ids=tokens[step[0]])

        def local_step():
            local(tokens[step[0]])
            step[0] += 1

        remote_t, local_t = interleaved(remote_step, local_step, args.decode_iters, warmup=20)
        # The two caches hold the same tokens: the next step's logits agree.
        last = tokens[step[0]]
        torch.testing.assert_close(s.step(input_ids=last), local(last), rtol=1e-4, atol=1e-4)
        dyn_samples = []
        for i in range(args.decode_iters):
            t = time.perf_counter_ns()
            dynamic = gpt(tokens[i], past_key_values=dynamic, use_cache=True).past_key_values
            dyn_samples.append((time.perf_counter_ns() - t) / 1e3)
        dynamic_t = percentiles(dyn_samples)
    lines += [row("GPT-2 small decode step through a djinn session (KV cache on the node)", remote_t),
              row("GPT-2 small decode step, local, same static KV cache (eager, 1 thread)", local_t),
              row("GPT-2 small decode step, local, Hugging Face DynamicCache (reference)", dynamic_t)]
    notes.append(f"GPT-2 small decode step: session p50 / local static-cache p50 = **{remote_t[0] / local_t[0]:.3f}** "
                 f"(target ≤ 1.2), p99 ratio {remote_t[1] / local_t[1]:.3f}; registration with the cache "
                 f"(two exports, upload, check, load) **{registration:.1f} s**; cache of {cache_len} positions")


def report(args, lines, notes):
    table = "\n".join(lines) + "\n\n" + ";  \n".join(notes) + ".\n"
    print(table)
    if args.results:
        machine = f"{os.cpu_count()} cores, {platform.platform()}"
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        flags = " --only-decode" if args.only_decode else f" --iters {args.iters} --gpt-iters {args.gpt_iters}"
        with open(args.results, "a") as f:
            f.write(f"\n### `bench/graphs.py` — {when}\n\nCommand: `.venv/bin/python bench/graphs.py{flags} "
                    f"--decode-iters {args.decode_iters}` (node: release build, 1 intra-op thread)  \n"
                    f"Machine: {machine}\n\n{table}")


if __name__ == "__main__":
    main()
