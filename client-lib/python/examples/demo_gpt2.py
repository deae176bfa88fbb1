"""The main job, end to end: register a GPT-2-small-shaped transformer (124M parameters, random
weights, built in code) as one block per layer, placed by the control plane (or on one node),
execute it remotely, and compare with the local result. Usage: demo_gpt2.py ADDRESS, the control
plane's http://HOST:PORT or a node's HOST:PORT"""
import statistics
import sys
import time

import torch

import djinn
from gpt import GPT, GPTConfig

torch.manual_seed(0)
torch.set_num_threads(1)  # the node computes with one thread per operation, like this
model = GPT(GPTConfig.small()).eval()
idx = torch.randint(0, model.config.vocab, (1, 64))
print(f"GPT-2-small-shaped model: {model.parameter_count() / 1e6:.1f}M parameters, {len(model.blocks())} blocks")

djinn.init(sys.argv[1])
started = time.perf_counter()


def progress(sent, total):
    print(f"\r  uploading {sent / 2**20:6.0f} / {total / 2**20:.0f} MiB", end="", flush=True)


rm = djinn.register(model, idx, blocks=model.blocks(), progress=progress)
registration = time.perf_counter() - started
print(f"\nregistered in {registration:.2f} s: {rm}")
if rm.placement is not None:
    p = rm.placement
    print(f"placed on {p['node']} ({p['addr']}) by rule {p['rule']}, policy {p['policy']}: "
          f"{p['cost']['compute_s'] * 1e3:.2f} ms of compute ({p['cost']['bound']}-bound) estimated per call")

with torch.no_grad():
    local = model(idx)
rm(idx)  # the first call pays the node's warm-up
times = []
for _ in range(10):
    t = time.perf_counter()
    out = rm(idx)
    times.append(time.perf_counter() - t)
print(f"largest absolute difference from the local result: {(out - local).abs().max().item():.3g}")
print(f"execute latency (batch 1, 64 tokens): median {statistics.median(times) * 1e3:.1f} ms, "
      f"min {min(times) * 1e3:.1f} ms over {len(times)} calls")
print(f"client: {djinn.stats()}")
