"""Writes the TorchScript archives the integration tests register, into the folder given.

Each model is saved whole (`NAME.pt`) and, where it is a stack of layers, also as blocks
(`NAME.block0.pt`, ...), so the tests can check that running the blocks in order gives the
whole model's output.
"""
import sys
from pathlib import Path
from typing import Dict, Tuple

import torch
from torch import nn

torch.manual_seed(0)
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)


def save(module, name, example=None):
    module = module.eval()
    scripted = torch.jit.trace(module, example) if example is not None else torch.jit.script(module)
    scripted.save(str(out / f"{name}.pt"))


mlp = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
save(mlp, "mlp", torch.randn(4, 256))
for i, layer in enumerate(mlp):
    save(layer, f"mlp.block{i}", torch.randn(4, 256 if i == 0 else 1024))


class Structured(nn.Module):
    def forward(self, x: torch.Tensor, scale: float, n: int) -> Dict[str, Tuple[torch.Tensor, Tuple[int, float, bool, str]]]:
        return {"scaled": (x * scale, (n + 1, scale * 2.0, n > 2, "ok")), "neg": (-x, (n, 0.5, False, "neg"))}


save(Structured(), "structured")


class Halves(nn.Module):
    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return x * 2, idx + 1


save(Halves(), "halves")


class Identity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


save(Identity(), "identity")


class Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.ones(3, 3)


save(Fails(), "fails")
# A stack of MLP blocks (1 MiB of weights each) and the tiny GPT, as blocks: what the streaming
# tests run under budgets that hold only some of them.
stack = [nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(8)]
for i, block in enumerate(stack):
    save(block, f"stack.block{i}", torch.randn(4, 512))

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "client-lib/python/examples"))
from gpt import GPT, GPTConfig  # noqa: E402

gpt = GPT(GPTConfig.tiny()).eval()
x = torch.randint(0, gpt.config.vocab, (1, 16))
for i, block in enumerate(gpt.blocks()):
    # The embedding is scripted, not traced: a trace would fix the device of its positions
    # (`torch.arange(..., device=idx.device)`) to the CPU it was traced on.
    save(block, f"gpt.block{i}", x if i > 0 else None)
    x = block(x)
print("models written to", out)


class GrowingCache(nn.Module):
    """A stateful model (the session contract): the inputs, then the state; it returns its
    output, then the new state. Like a KV cache, the state grows by each step's input."""

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        cache = torch.cat([cache, x], dim=0)
        return cache.sum(dim=0), cache


save(GrowingCache(), "growing_cache")


class Counter(nn.Module):
    """Two state tensors, one of them a step count; two outputs."""

    def forward(self, x: torch.Tensor, total: torch.Tensor, steps: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        total = total + x
        steps = steps + 1
        return total * 2, steps * 10, total, steps


save(Counter(), "counter")


class Doubler(nn.Module):
    """Block 0 of a stateful model in two blocks: the state passes through."""

    def forward(self, x: torch.Tensor, total: torch.Tensor, steps: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x * 2, total, steps


class Accumulator(nn.Module):
    """Block 1: adds its input to the running total; returns the total, then the new state."""

    def forward(self, y: torch.Tensor, total: torch.Tensor, steps: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        total = total + y
        return total, total, steps + 1


save(Doubler(), "stateful.block0")
save(Accumulator(), "stateful.block1")
