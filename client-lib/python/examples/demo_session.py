"""A session: greedy generation with the GPT-2-small-shaped transformer's KV cache kept on the
node between steps, moved to host memory while the "agent" waits on a tool, and the tokens
compared with a local generation. Usage: demo_session.py ADDRESS (as demo_gpt2.py)."""
import statistics
import sys
import time

import torch

import djinn
from gpt import GPT, CachedGPT, GPTConfig, generate, greedy

torch.manual_seed(0)
torch.set_num_threads(1)
gpt = GPT(GPTConfig.small()).spread_weights(0.1).eval()
cached = CachedGPT(gpt).eval()
prompt = torch.randint(0, gpt.config.vocab, (1, 16))
new_tokens, length = 16, 64
client = djinn.init(sys.argv[1])
rm = djinn.register(cached, (prompt, *cached.empty_state(length=length)))
state = cached.empty_state(length=length)
print(f"KV cache for {length} tokens: {sum(t.numel() * t.element_size() for t in state) / 2**20:.1f} MiB, "
      f"uploaded once when the session opens")

times = []
with rm.session(*state) as s:
    def step(tokens):
        started = time.perf_counter()
        logits = s.step(tokens)
        times.append(time.perf_counter() - started)
        if len(times) % 4 == 0:
            s.io_wait(20)  # a tool call of ~20 ms: the cache goes to host memory and comes back ahead
            time.sleep(0.02)
        return logits

    sent = client.stats()["bytes_sent"]
    tokens = greedy(step, prompt, new_tokens)
    sent = client.stats()["bytes_sent"] - sent
expected = generate(gpt, prompt, new_tokens)
print(f"generated {tokens.tolist()[0]}")
print(f"equal to the local generation: {torch.equal(tokens, expected)}; "
      f"{sent} bytes sent for {len(times)} steps; step median {statistics.median(times) * 1e3:.1f} ms")
if not torch.equal(tokens, expected):
    sys.exit("the session's tokens differ from the local generation")
