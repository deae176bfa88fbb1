"""A session: greedy generation with a GPT-2-small-shaped Hugging Face model (124M parameters,
random weights, built from its config) registered with a static KV cache (`cache_len=`): the
cache lives on the node between steps, each step sends only its new token, the session is
moved to host memory while the "agent" waits on a tool, and the tokens are compared with the
same model's local greedy `generate` (exits non-zero when any differs). Usage: demo_session.py ADDRESS (as demo_gpt2.py)."""
import statistics
import sys
import time

import torch
import transformers

import djinn

torch.manual_seed(0)
torch.set_num_threads(1)
# Weights drawn wider than the default (0.02), so that greedy decoding varies its tokens and a
# wrong cache would show in them.
config = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=256, initializer_range=0.1)
lm = transformers.GPT2LMHeadModel(config).eval()
prompt = torch.randint(0, config.vocab_size, (1, 16))
new_tokens, length = 16, 64
client = djinn.init(sys.argv[1])
rm = djinn.register(lm, {"input_ids": prompt}, dynamic={"input_ids": {1: ("seq", 2, length)}}, cache_len=length)
cache_bytes = 2 * config.n_layer * length * config.n_embd * 4
print(f"KV cache for {length} tokens: {cache_bytes / 2**20:.1f} MiB, made on the node when the session opens")

times = []
with rm.session() as s:
    def step(tokens):
        started = time.perf_counter()
        logits = s.step(input_ids=tokens)
        times.append(time.perf_counter() - started)
        if len(times) % 4 == 0:
            s.io_wait(20)  # a tool call of ~20 ms: the cache goes to host memory and comes back ahead
            time.sleep(0.02)
        return logits

    sent = client.stats()["bytes_sent"]
    logits = step(prompt)
    tokens = []
    for i in range(new_tokens):
        tokens.append(logits[:, -1].argmax(-1, keepdim=True))
        if i + 1 < new_tokens:
            logits = step(tokens[-1])
    tokens = torch.cat(tokens, 1)
    sent = client.stats()["bytes_sent"] - sent
with torch.no_grad():
    expected = lm.generate(prompt, max_new_tokens=new_tokens, do_sample=False)[:, prompt.shape[1]:]
print(f"generated {tokens.tolist()[0]}")
print(f"equal to the local generation: {torch.equal(tokens, expected)}; "
      f"{sent} bytes sent for {len(times)} steps; step median {statistics.median(times) * 1e3:.1f} ms")
if not torch.equal(tokens, expected):
    sys.exit(f"FAILED: the session's tokens {tokens.tolist()[0]} differ from the local generate's "
             f"{expected.tolist()[0]}")
