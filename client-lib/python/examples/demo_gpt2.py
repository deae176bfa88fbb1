"""The main job, end to end: register a GPT-2-small-shaped transformer (124M parameters, random
weights, built in code) as one block per layer, placed by the control plane (or on one node),
execute it remotely, and compare with the local result: exits non-zero when any call's output
differs from the local one by more than 1e-4 anywhere. Usage: demo_gpt2.py ADDRESS, the control
plane's http://HOST:PORT or a node's HOST:PORT"""
import statistics
import sys
import time

import torch

import djinn
from gpt import GPT, GPTConfig

# The largest absolute difference from the local result that passes: the node runs the same
# float32 operators with one thread, so the two differ by rounding only (about 1e-6 here).
TOLERANCE = 1e-4
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


def difference(out) -> float:
    """The largest absolute difference from the local result (NaN where the shapes differ or
    a value is NaN, which the check below fails)."""
    if not isinstance(out, torch.Tensor) or out.shape != local.shape:
        return float("nan")
    return (out - local).abs().max().item()


differences = [difference(rm(idx))]  # the first call pays the node's warm-up
times = []
for _ in range(10):
    t = time.perf_counter()
    out = rm(idx)
    times.append(time.perf_counter() - t)
    differences.append(difference(out))
worst = max(differences, key=lambda d: float("inf") if d != d else d)
print(f"largest absolute difference from the local result: {worst:.3g} over {len(differences)} calls")
print(f"execute latency (batch 1, 64 tokens): median {statistics.median(times) * 1e3:.1f} ms, "
      f"min {min(times) * 1e3:.1f} ms over {len(times)} calls")
print(f"client: {djinn.stats()}")
if not worst <= TOLERANCE:  # NaN fails too
    sys.exit(f"FAILED: the remote result differs from the local one by {worst:.3g}, more than {TOLERANCE:g}")
print(f"equal to the local result within {TOLERANCE:g}")
