"""Writes the model `djinn bench agents` runs: the tiny transformer of the Python package's GPT
example (vocabulary 97, width 64, 4 heads, 2 layers) with a context of CONTEXT tokens, decoding
as a CachedGPT, scripted. Prints the shape of its KV cache (comma-separated).

Usage: agents_model.py CONTEXT OUT"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client-lib" / "python" / "examples"))

import torch  # noqa: E402
from gpt import GPT, CachedGPT, GPTConfig  # noqa: E402

context, out = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
config = GPTConfig.tiny()
config.context = context
model = CachedGPT(GPT(config).spread_weights(0.3)).eval()
torch.jit.script(model).save(out)
print(",".join(str(d) for d in model.empty_state()[0].shape))
