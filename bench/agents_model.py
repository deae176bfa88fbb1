"""Writes the model `djinn bench agents` runs: the tiny transformer of the Python package's GPT
example (vocabulary 97, width 64, 4 heads, 2 layers) with a context of CONTEXT tokens, decoding
one token a step with a KV cache, twice with the same weights: as a CachedGPT, scripted, to OUT
(its cache and position are the session's state the client gives); and as a graph, to
OUT.graph (its cache and position are buffers it writes in place, which the node keeps as the
session's state). Prints the shape of the scripted model's KV cache (comma-separated).

Usage: agents_model.py CONTEXT OUT"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client-lib" / "python" / "examples"))
sys.path.insert(0, str(ROOT / "client-lib" / "python"))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from djinn import graphs  # noqa: E402
from gpt import GPT, CachedGPT, GPTConfig  # noqa: E402


class GraphDecoder(nn.Module):
    """`cached`'s step with its state as buffers: each layer's keys and values, written in
    place at the step's position, and the position, moved on by the step."""

    def __init__(self, cached: CachedGPT, context: int):
        super().__init__()
        self.cached = cached
        c = cached.config
        for i in range(c.layers):
            for kind in ("keys", "values"):
                self.register_buffer(f"{kind}_{i}", torch.zeros(1, c.heads, context, c.width // c.heads), persistent=False)
        self.register_buffer("position", torch.zeros(1, dtype=torch.int64), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = self.position + torch.arange(tokens.size(1))
        x = self.cached.embedding.token(tokens) + self.cached.embedding.position(positions)
        for i, layer in enumerate(self.cached.layers):
            x = layer.cached(x, getattr(self, f"keys_{i}"), getattr(self, f"values_{i}"), positions)
        self.position.copy_(positions[-1:] + 1)
        return self.cached.head(x[:, -1])


context, out = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
config = GPTConfig.tiny()
config.context = context
model = CachedGPT(GPT(config).spread_weights(0.3)).eval()
torch.jit.script(model).save(out)
graph = graphs.export(GraphDecoder(model, context).eval(), (torch.zeros(1, 1, dtype=torch.int64),))
Path(out + ".graph").write_bytes(graph.containers[0])
print(",".join(str(d) for d in model.empty_state()[0].shape))
